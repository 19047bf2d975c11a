"""`python -m jaxserve.generate`: streams a reply to the terminal."""

import subprocess
import sys

from jaxserve.generate import main


def test_streams_the_reply_and_reports_the_count(tiny_models, tmp_path, capsys):
    directory = tiny_models("llama")[0]
    code = main(["Hello", "--model", str(directory), "--max-tokens", "6", "--temperature", "0",
                 "--compile-cache-dir", str(tmp_path / "cache")])
    captured = capsys.readouterr()
    assert code == 0
    assert "[6 tokens in" in captured.err and "finish: length" in captured.err
    assert captured.out.strip()


def test_bad_flag_value_names_it():
    result = subprocess.run([sys.executable, "-m", "jaxserve.generate", "hi", "--dtype", "float8"],
                            capture_output=True, text=True)
    assert result.returncode == 2 and "float8" in result.stderr


def test_out_of_range_sampling_value_is_a_clear_error(capsys):
    assert main(["hi", "--max-tokens", "0"]) == 2
    assert "max_tokens=0 is out of range: must be >= 1" in capsys.readouterr().err
