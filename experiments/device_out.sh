# shellcheck shell=bash
# Sourced by the scripts that run on a lent GPU machine (gpu_speed.sh, orig_gpu_speed.sh). The device tool brings
# back at most 8 files from $OUT (16 MiB each; ../.library/device/README.md), and a run of levers or configs
# writes a .json and a .log per run. So every file goes to a scratch folder, and device_out_sync, called after
# each run, copies the summaries named in DEVICE_OUT_FILES to $OUT as they are and packs the whole folder into
# $OUT/raw.tgz (written whole, then renamed: a command killed at its limit leaves the previous complete one).
#
#   device_out_begin DEFAULT_OUT   # DEVICE_OUT_DEST := $OUT (or DEFAULT_OUT); OUT := the scratch folder
#   device_out_sync                # after every run, and once more at the end
# Here: `tar -xzf FILES_AT/raw.tgz -C DIR` restores every run's files.

device_out_begin() {
  DEVICE_OUT_DEST=${OUT:-$1}
  mkdir -p "$DEVICE_OUT_DEST"
  OUT=$(mktemp -d "${TMPDIR:-/tmp}/device_out.XXXXXX")
}

device_out_sync() {
  local f
  for f in ${DEVICE_OUT_FILES:-}; do
    if [ -f "$OUT/$f" ]; then cp "$OUT/$f" "$DEVICE_OUT_DEST/$f"; fi
  done
  tar -C "$OUT" -czf "$DEVICE_OUT_DEST/raw.tgz.part" . && mv -f "$DEVICE_OUT_DEST/raw.tgz.part" "$DEVICE_OUT_DEST/raw.tgz"
}
