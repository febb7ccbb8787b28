"""The main job's final table: the real worker count, one line per configuration when piped."""
from hipress_like.demo.cli_digits import _table


def test_final_table_names_the_workers_and_does_not_wrap_when_piped(capsys):
    rows = [{"configuration": "CaSync onebit", "test acc %": "97.2", "train time s": "12.7",
             "wall time s": "31.6", "images/s": "1172", "speed-up": "1.02x"},
            {"configuration": "no compression", "test acc %": "97.2", "train time s": "12.9",
             "wall time s": "23.1", "images/s": "1154", "speed-up": "1.00x"}]
    _table(rows, 2)
    out = capsys.readouterr().out
    assert "digits, 2 workers" in out
    # each configuration, with all its cells, on one line
    assert any("CaSync onebit" in line and "1.02x" in line for line in out.splitlines())
    assert any("no compression" in line and "1.00x" in line for line in out.splitlines())
