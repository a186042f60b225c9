"""TensorBoard scalars without TensorFlow: event files written record by record.

An event file is a TFRecord stream of `tensorboard.Event` protos. Each record is
  uint64 length | uint32 masked-crc32c(length) | payload | uint32 masked-crc32c(payload)   (little-endian)
and the few proto fields a scalar needs are encoded here by hand (field numbers from tensorboard's
event.proto and summary.proto), so the default install needs neither TensorFlow nor tensorboardX:

  Event:      wall_time = 1 (double), step = 2 (int64), file_version = 3 (string), summary = 5 (Summary),
              session_log = 7 (SessionLog)
  Summary:    value = 1 (repeated Value)
  Value:      tag = 1 (string), simple_value = 2 (float)
  SessionLog: status = 1 (enum; START = 1)

`tensorboard --logdir <workdir>/tb` reads them.
"""

from __future__ import annotations

import os
import socket
import struct
import time


def _make_table() -> list[int]:
  table = []
  for byte in range(256):
    crc = byte
    for _ in range(8):
      crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1  # CRC-32C (Castagnoli), reflected
    table.append(crc)
  return table


_CRC_TABLE = _make_table()


def crc32c(data: bytes) -> int:
  crc = 0xFFFFFFFF
  for byte in data:
    crc = _CRC_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
  return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
  """TFRecord's mask: a CRC stored next to the data it covers would otherwise be easy to confuse with it."""
  crc = crc32c(data)
  return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def tfrecord(payload: bytes) -> bytes:
  header = struct.pack("<Q", len(payload))
  return header + struct.pack("<I", masked_crc32c(header)) + payload + struct.pack("<I", masked_crc32c(payload))


# Protobuf wire format: a key is (field << 3 | wire type); 0 varint, 1 fixed64, 2 length-delimited, 5 fixed32.
def _varint(n: int) -> bytes:
  out = bytearray()
  while True:
    low, n = n & 0x7F, n >> 7
    out.append(low | (0x80 if n else 0))
    if not n:
      return bytes(out)


def _bytes_field(field: int, data: bytes) -> bytes:
  return _varint(field << 3 | 2) + _varint(len(data)) + data


def _event(step: int, wall_time: float, body: bytes) -> bytes:
  return _varint(1 << 3 | 1) + struct.pack("<d", wall_time) + _varint(2 << 3 | 0) + _varint(max(int(step), 0)) + body


def scalar_event(step: int, values: dict[str, float], wall_time: float) -> bytes:
  summary = b"".join(
      _bytes_field(1, _bytes_field(1, tag.encode()) + _varint(2 << 3 | 5) + struct.pack("<f", float(v)))
      for tag, v in values.items())
  return _event(step, wall_time, _bytes_field(5, summary))


class EventWriter:
  """Appends scalar events to a new `events.out.tfevents.*` file in `logdir`; every call is flushed, so a
  killed run loses nothing it logged. `enabled=False` (processes other than 0) makes every call a no-op."""

  def __init__(self, logdir: str, enabled: bool = True):
    self._file = None
    if not enabled:
      return
    os.makedirs(logdir, exist_ok=True)
    name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}"
    self.path = os.path.join(logdir, name)
    self._file = open(self.path, "ab")
    self._write(_event(0, time.time(), _bytes_field(3, b"brain.Event:2")))

  def _write(self, event: bytes) -> None:
    if self._file is not None:
      self._file.write(tfrecord(event))
      self._file.flush()

  def scalars(self, step: int, values: dict[str, float]) -> None:
    self._write(scalar_event(step, values, time.time()))

  def restart(self, step: int) -> None:
    """A resumed run: a SessionLog START at `step` tells TensorBoard to drop events at `step` and later from
    the interrupted run (they are logged again), as TensorFlow's own writer does on restart."""
    self._write(_event(step, time.time(), _bytes_field(7, _varint(1 << 3 | 0) + _varint(1))))

  def close(self) -> None:
    if self._file is not None:
      self._file.close()
      self._file = None
