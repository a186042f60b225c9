"""One line per error, whatever the library raised: `errors.first_line` and the readers that quote it."""

import pytest

from trime_jax import data
from trime_jax.errors import DataError, first_line
from trime_jax.mt.data import SubwordVocab


def test_first_line():
  assert first_line(RuntimeError()) == "RuntimeError: "  # an empty message is not an IndexError
  assert first_line(ValueError("  \n")) == "ValueError: "
  assert first_line(OSError("first\nsecond")) == "OSError: first"
  assert first_line(KeyError("x" * 500)) == "KeyError: '" + "x" * 199


def test_truncated_json_names_the_file_and_the_parser_error(tmp_path):
  path = tmp_path / "meta.json"
  path.write_text('{"count": 3, "dimen')
  with pytest.raises(DataError) as e:
    data.read_json(str(path), "datastore metadata", DataError)
  assert str(e.value).startswith(f"datastore metadata {path} is corrupt or truncated (JSONDecodeError: ")
  assert "\n" not in str(e.value)


@pytest.mark.parametrize("content,error", [('{"words": []}', "KeyError: 'tokens'"),
                                           ('{"tokens": [1', "JSONDecodeError: ")])
def test_damaged_subword_vocabulary_is_one_line(tmp_path, content, error):
  (tmp_path / SubwordVocab.FILES["bpe"]).write_text(content)
  with pytest.raises(DataError) as e:
    SubwordVocab.load(str(tmp_path))
  assert str(e.value).startswith(f"damaged vocabulary file in {tmp_path}: {error}")
  assert "\n" not in str(e.value)
