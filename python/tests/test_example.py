"""examples/moe_layer.py runs on the host backend with NumPy and agrees with its local reference."""

import os
import subprocess
import sys

import pytest

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "moe_layer.py")


@pytest.mark.parametrize("nranks", [1, 2, 4])
def test_moe_layer_example(nranks):
    run = subprocess.run([sys.executable, EXAMPLE, "--ranks", str(nranks)], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count(" ok") == nranks, run.stdout
