"""The quick start's main job: ``python -m torch_mirage demo`` compiles a real model and reports what it did."""
import subprocess
import sys

import pytest
import torch


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU demo is a timing run; the CPU path is what CI checks")
def test_demo_compiles_a_llama_block_and_reports_regions():
    proc = subprocess.run([sys.executable, "-m", "torch_mirage", "demo"], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = proc.stdout
    assert "relative error vs eager" in out and "(ok," in out
    mirage = [line for line in out.splitlines() if line.strip().startswith("mirage ")]
    assert mirage and any("stitch" in line for line in mirage), out[-3000:]
    assert "disagrees with eager" not in proc.stderr, proc.stderr[-2000:]
