"""README.md cannot go stale: every Python block runs as written, and quoted layout-check values match.

* Each ```python block runs in a fresh process on the CPU (``python block.py``), and also under
  ``torchrun --nproc-per-node 2`` when an HTML comment ``<!-- readme-test: also under torchrun ... -->``
  stands right before it.
* A block whose first line is ``# not run: ...`` (it needs the reader's own files) is run on a tiny
  generated Hugging Face checkpoint instead, with its paths replaced.
* The first-step loss and grad norm quoted in the ``figures:layout-check`` block equal what
  ``examples/ppo_toy.py --layout-check`` prints now, on 1 process and on 2 (DP=2), to 1e-6 relative.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BLOCK = re.compile(r"(<!-- readme-test: ([^>]*)-->\n)?```python\n(.*?)```", re.S)
BLOCKS = [(m.group(3), (m.group(2) or "").strip()) for m in BLOCK.finditer(README)]
NOT_RUN = "# not run:"


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")


def _run_file(path: Path, nproc: int, timeout: int = 600) -> subprocess.CompletedProcess:
    if nproc == 1:
        cmd = [sys.executable, str(path)]
    else:
        from fnppo.megatron.parallel import free_port

        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={free_port()}", str(path)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=path.parent, timeout=timeout)
    assert out.returncode == 0, f"{cmd} failed:\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}"
    return out


def _block_id(i: int) -> str:
    return f"block{i}-" + re.sub(r"\W+", "_", BLOCKS[i][0].splitlines()[0])[:30]


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 3, "README.md lost its code examples"
    assert sum(b.startswith(NOT_RUN) for b, _ in BLOCKS) == 1  # only the Hugging Face block


@pytest.mark.parametrize("i", [i for i, (b, _) in enumerate(BLOCKS) if not b.startswith(NOT_RUN)], ids=_block_id)
def test_python_block_runs_as_written(i, tmp_path):
    code, marker = BLOCKS[i]
    path = tmp_path / "block.py"
    path.write_text(code)
    out = _run_file(path, 1)
    assert out.stdout.strip(), "a README example should print what it computed"
    assert "Warning" not in out.stderr, out.stderr[-3000:]  # fnppo is quiet by default
    if "torchrun --nproc-per-node 2" in marker:
        out2 = _run_file(path, 2)
        assert out2.stdout.strip()


def test_compose_block_reports_the_same_metrics_on_one_and_two_ranks(tmp_path):
    code = next(b for b, m in BLOCKS if "torchrun" in m)
    path = tmp_path / "compose.py"
    path.write_text(code)
    one = _run_file(path, 1).stdout.strip().splitlines()[-1]
    two = _run_file(path, 2).stdout.strip().splitlines()[-1]
    import ast

    a, b = ast.literal_eval(one), ast.literal_eval(two)
    assert a.keys() == b.keys()
    for k in a:
        assert abs(a[k] - b[k]) <= 2e-5 * max(1.0, abs(a[k])), (k, a[k], b[k])


def test_hugging_face_block_on_a_tiny_checkpoint(tmp_path):
    transformers = pytest.importorskip("transformers")
    import torch

    code = next(b for b, _ in BLOCKS if b.startswith(NOT_RUN))
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
    )
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(tmp_path / "ckpt")
    paths = re.findall(r'"(/[^"]+)"', code)
    assert sorted(set(paths)) == ["/ckpt/Qwen3-0.6B", "/out/step-100"], paths
    code = code.replace("/ckpt/Qwen3-0.6B", str(tmp_path / "ckpt")).replace("/out/step-100", str(tmp_path / "out"))
    code += "\nprint('log-probs of the sample:', None if logprobs is None else logprobs[0].tolist())\n"
    path = tmp_path / "hf_block.py"
    path.write_text(code)
    nproc = int(re.search(r"init_parallel\(tp=(\d+)", code).group(1))
    out = _run_file(path, nproc)
    assert "log-probs of the sample" in out.stdout
    assert (tmp_path / "out" / "config.json").is_file() and (tmp_path / "out" / "model.safetensors").is_file()


LAYOUT_CHECK = re.compile(r"<!-- figures:layout-check -->\n```\n(.*?)```", re.S)
LINE = re.compile(r"^\$ (.*?)\s+# loss=(\S+) grad_norm=(\S+)$", re.M)
PRINTED = re.compile(r"first-step loss=(\S+) grad_norm=(\S+)")


@pytest.mark.parametrize("which", [0, 1], ids=["1proc", "dp2"])
def test_quoted_layout_check_values_match_the_code(which, tmp_path):
    block = LAYOUT_CHECK.search(README)
    assert block, "README.md lost its figures:layout-check block"
    lines = LINE.findall(block.group(1))
    assert len(lines) == 2, lines
    cmd, loss, norm = lines[which]
    args = cmd.split()
    assert args[-5:] == ["examples/ppo_toy.py", "--steps", "1", "--layout-check", "--target-reward", "0"][-5:]
    run_args = ["--no-progress", "--no-plot", "--out-dir", str(tmp_path / "run"), "--steps", "1", "--layout-check", "--target-reward", "0"]
    if args[0] == "torchrun":
        from fnppo.megatron.parallel import free_port

        full = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}", str(ROOT / "examples/ppo_toy.py"), *run_args]
    else:
        full = [sys.executable, str(ROOT / "examples/ppo_toy.py"), *run_args]
    out = subprocess.run(full, capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    m = PRINTED.search(out.stdout)
    assert m, out.stdout
    for quoted, printed in ((loss, m.group(1)), (norm, m.group(2))):
        assert abs(float(quoted) - float(printed)) <= 1e-6 * abs(float(printed)), f"README quotes {quoted}, the code prints {printed}: run benchmarks/readme_figures.py --write"
