"""The guides under docs/ cannot go stale: their code runs, their links resolve, the site builds.

* Each ```python block of a guide runs as written, in a fresh process on the CPU (every block is a
  complete program a reader can copy), and also on two processes with the environment ``torchrun
  --nproc-per-node 2`` gives them when an HTML comment ``<!-- docs-test: also under torchrun ...
  -->`` stands right before it. The processes are forks of one that has imported torch, Megatron and
  fnppo once (the block runs as ``__main__`` in its own directory; that these imports print no
  warning is checked once, in a new interpreter).
* A block whose first line is ``# not run: <why>`` (it needs a GPU, several processes or the
  reader's own files) is skipped with that reason; the Hugging Face block is run instead on a tiny
  generated checkpoint, with its paths replaced.
* Every relative link of README.md, BENCHMARKS.md, CONTRIBUTING.md and docs/ points to a file that
  exists and, with an anchor, to a heading of that file whose anchor is the same on GitHub and on
  the site; every page is in the site's navigation.
* No command in them calls a bare ``python`` or ``torchrun``: the environment of README's main
  command is ``.venv`` and is never activated by it.
* ``mkdocs build --strict`` passes (when mkdocs-material and mkdocstrings-python are installed), and
  every API page documents every name of its namespace's ``__all__``.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

from tests.scripts import PRELOAD, run_script, script_env

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(p for p in DOCS.rglob("*.md") if "_hooks" not in p.parts)
ROOT_FILES = [ROOT / "README.md", ROOT / "BENCHMARKS.md", ROOT / "CONTRIBUTING.md"]
GUIDES = [
    "compose",
    "critic",
    "moe",
    "long-context",
    "vlm",
    "fused-output",
    "shared-prefix",
    "batch-invariance",
    "distillation",
    "huggingface",
    "lora",
    "checkpoints",
    "gpu",
    "testing",
    "errors",
]  # the topic guides, each with code that runs or says why it cannot
BLOCK = re.compile(r"(<!-- docs-test: ([^>]*)-->\n)?```python\n(.*?)```", re.S)
NOT_RUN = "# not run:"


def _blocks() -> list[tuple[str, str, str]]:
    """(id, code, marker) of every python block of the pages under docs/."""
    out = []
    for page in PAGES:
        for i, m in enumerate(BLOCK.finditer(page.read_text())):
            out.append((f"{page.relative_to(DOCS).as_posix()}-{i}", m.group(3), (m.group(2) or "").strip()))
    return out


BLOCKS = _blocks()


def _run_file(path: Path, nproc: int, timeout: int = 900) -> subprocess.CompletedProcess:
    """``python path`` (``torchrun --nproc-per-node nproc path``) as :func:`tests.scripts.run_script`
    runs it; asserts that it exited with 0."""
    out = run_script(path, nproc=nproc, timeout=timeout)
    assert out.returncode == 0, (
        f"{path} on {nproc} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}"
    )
    return out


def test_importing_what_the_blocks_import_prints_no_warning():
    """The blocks run in forks of a process that imported these already: the import itself, once, here."""
    code = "import importlib\nfor m in " + repr(PRELOAD) + ":\n    importlib.import_module(m)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=script_env(), timeout=300)
    assert out.returncode == 0 and "Warning" not in out.stderr, out.stderr[-3000:]


def test_every_guide_exists_and_has_code():
    have = {p.stem for p in PAGES if p.parent == DOCS}
    assert not set(GUIDES) - have, set(GUIDES) - have
    for name in GUIDES:
        assert "```python" in (DOCS / f"{name}.md").read_text(), f"docs/{name}.md has no python block"


@pytest.mark.parametrize("i", range(len(BLOCKS)), ids=[b[0] for b in BLOCKS])
def test_python_block_runs_as_written(i, tmp_path):
    name, code, marker = BLOCKS[i]
    if code.startswith(NOT_RUN):
        pytest.skip(f"{name}: {code.splitlines()[0][len(NOT_RUN) :].strip()}")
    path = tmp_path / "block.py"
    path.write_text(code)
    out = _run_file(path, 1)
    assert "Warning" not in out.stderr, out.stderr[-3000:]  # fnppo is quiet by default
    if "torchrun --nproc-per-node 2" in marker:
        _run_file(path, 2)


def test_hugging_face_block_on_a_tiny_checkpoint(tmp_path):
    transformers = pytest.importorskip("transformers")
    import torch

    code = next(c for name, c, _ in BLOCKS if name.startswith("huggingface.md") and c.startswith(NOT_RUN))
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
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


# ---------------------------------------------------------------------------------------------
# links and commands
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} (.+?)\s*$", re.M)
FENCE = re.compile(r"```.*?```", re.S)


def _github_slug(heading: str) -> str:
    text = re.sub(r"[^\w\- ]", "", heading.replace("`", "").strip().lower())
    return text.replace(" ", "-")


def _site_slug(heading: str) -> str:  # Python-Markdown's toc.slugify (MkDocs' default)
    text = unicodedata.normalize("NFKD", heading.replace("`", "")).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _headings(path: Path) -> list[str]:
    return HEADING.findall(FENCE.sub("", path.read_text()))


@pytest.mark.parametrize("page", ROOT_FILES + PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page):
    bad = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no such file")
            continue
        if anchor:
            slugs = {(_github_slug(h), _site_slug(h)) for h in _headings(dest)}
            if (anchor, anchor) not in slugs:
                bad.append(
                    f"{target}: no heading with that anchor on both GitHub and the site ({sorted(slugs)[:3]}...)"
                )
    assert not bad, f"{page.name}: {bad}"


COMMAND = re.compile(r"(?:^|`|\$ )((?:python3?|torchrun) [^\n`]*)", re.M)


@pytest.mark.parametrize("page", ROOT_FILES + PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_command_calls_a_bare_python_or_torchrun(page):
    text = page.read_text()
    bare = [c for c in COMMAND.findall(text) if not c.startswith("python3 -m venv")]
    assert not bare, (
        f"{page.name}: use .venv/bin/python / .venv/bin/torchrun (README's main command never activates .venv): {bare}"
    )


TEST_REF = re.compile(r"`(tests/test_\w+\.py)::(test_\w+)(\[[^\]`]*\])?`")


def test_every_test_named_in_the_docs_exists():
    """README and the guides cite tests by name (docs/errors.md: tests/test_errors_doc.py); each must be a
    test function of that file (pytest collects module-level ``test*`` functions)."""
    refs = set()
    for page in ROOT_FILES + PAGES:
        if page != DOCS / "errors.md":
            refs |= {(f, name) for f, name, _ in TEST_REF.findall(page.read_text())}
    assert refs
    ids = set()
    for f in {f for f, _ in refs}:
        if (ROOT / f).is_file():
            tree = ast.parse((ROOT / f).read_text())
            ids |= {f"{f}::{n.name}" for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test")}
    missing = sorted(f"{f}::{name}" for f, name in refs if f"{f}::{name}" not in ids)
    assert not missing, f"tests named in the docs that do not exist: {missing}"


def test_every_page_is_in_the_site_navigation():
    nav = set(re.findall(r":\s*(\S+\.md)\s*$|^\s*-\s*(\S+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M))
    listed = {a or b for a, b in nav}
    missing = [p.relative_to(DOCS).as_posix() for p in PAGES if p.relative_to(DOCS).as_posix() not in listed]
    assert not missing, f"pages missing from mkdocs.yml's nav: {missing}"


# ---------------------------------------------------------------------------------------------
# the site
def _api_pages() -> list[tuple[Path, str]]:
    out = []
    for page in sorted((DOCS / "api").glob("*.md")):
        m = re.search(r"^::: (\S+)$", page.read_text(), re.M)
        if m:
            out.append((page, m.group(1)))
    return out


def test_every_namespace_has_an_api_page():
    documented = {mod for _, mod in _api_pages()}
    expected = {"fnppo"} | {
        f"fnppo.{n}"
        for n in (
            "losses",
            "advantages",
            "kl",
            "metrics",
            "batching",
            "models",
            "parallel",
            "moe",
            "vlm",
            "hf",
            "checkpoint",
            "sinks",
            "lora",
            "ops",
            "typing",
            "testing",
        )
    }
    assert documented == expected, documented ^ expected


def test_mkdocs_build_strict_documents_every_public_name(tmp_path):
    for module in ("mkdocs", "material", "mkdocstrings_handlers.python"):
        pytest.importorskip(module)
    site = tmp_path / "site"
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
        cwd=ROOT,
        env=script_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    for page, module in _api_pages():
        namespace = importlib.import_module(module)
        names = getattr(namespace, "__all__", None)
        assert names, f"{module} has no __all__: its API page would document nothing"
        html = (site / "api" / page.stem / "index.html").read_text()
        objects = [
            n for n in names if not inspect.ismodule(getattr(namespace, n))
        ]  # namespaces have pages of their own
        missing = [n for n in objects if f'id="{module}.{n}"' not in html]
        assert not missing, f"{page.name} does not document {missing}"
