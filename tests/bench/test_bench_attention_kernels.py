"""bench.attention_kernels --decode: it runs our decode kernel on the layout it describes (checked against SDPA
first) and rejects bad shapes."""

from __future__ import annotations

import pytest

from bench import attention_kernels
from serve.model import kernels


@pytest.mark.skipif(kernels.ops() is None, reason=f"CPU kernels unavailable: {kernels.describe()}")
def test_decode_table_has_one_row_per_shape_with_the_bytes_read() -> None:
    out = attention_kernels.run_decode([(8, 64), (1, 33)], repeats=1).splitlines()
    rows = [line for line in out if line.startswith("| 8 x 64 |") or line.startswith("| 1 x 33 |")]
    assert len(rows) == 2
    # K and V, 3 kv heads x 64 fp32 per token, 8 x 64 tokens: 8 * 64 * 2 * 3 * 64 * 4 bytes = 0.75 MiB
    assert rows[0].split("|")[2].strip() == "0.8 MiB"


@pytest.mark.parametrize("bad", ["32", "32x", "0x16", "4x-1", "axb"])
def test_decode_rejects_bad_shapes(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        attention_kernels.main(["--decode", bad])
    assert exc.value.code == 2
    assert "--decode" in capsys.readouterr().err
