"""GPU end-to-end smoke check: the gateway in front of a real ``lmdeploy serve api_server`` it launches.

Run it with ``bash deploy/gpu_smoke.sh`` from the repository root on a machine with one CUDA GPU,
Python 3.12 with torch/transformers/tokenizers, and the missing wheels in ``.whl/`` (the script
installs them into /tmp/site; see gpu_smoke.sh). No network is needed: the models are random-weight
models built on the spot.

What it does, each step bounded in time (the whole run stays under ``GPU_SMOKE_BUDGET`` seconds,
360 by default):

1. builds a tiny random-weight Qwen2 chat model (2 layers, hidden 128, a byte-level BPE tokenizer
   trained here, a ChatML chat template) under ``$GPU_SMOKE_WORK`` (/tmp/gpu_smoke);
2. a tiny random-weight Qwen2-VL model (unless ``GPU_SMOKE_VLM=0``), served by an api_server this
   script starts itself while the gateway's instance loads, and added to the gateway's pool through
   the admin listener (``POST /admin/backends``) once healthy; its checks are optional and come after
   the text checks, so a VLM failure cannot hide them;
3. writes a gateway config: one ``launch:`` group (engine lmdeploy, backend pytorch, gpus [0], tp 1,
   cache_max_entry_count 0.3, session_len 2048, eager_mode), two client keys (one ``admin: true``)
   and the admin listener;
4. starts ``python -m gateway serve --config ... --internal-key-fd N`` (the hidden flag the
   ``--workers`` parent uses; here it lets this script know the api_server's internal key so that it
   can read the backend's own /metrics) and waits for ``/ready``, printing the instance log's tail;
5. through the gateway, with the ``openai`` SDK: a chat completion, a streamed chat with
   ``stream_options.include_usage``, an image request (a base64 PNG ``data:`` URL), ``/v1/models``;
   with plain HTTP: no key (401), lmdeploy's admin routes ``/terminate`` and ``/nodes/add`` (never
   forwarded: 404), the gateway's ``/metrics`` (403 for a plain key, 200 for an admin key), the admin
   listener's ``/admin/backends``; the backend's own ``/metrics`` without a key (401) and with the
   internal key (200, then parsed by ``gateway.routing.signals.parse_metrics``, the scraper's parser);
   then (optional checks, ``GPU_SMOKE_LOAD=0`` leaves them out) 96 streamed chats 32 at a time through
   the gateway on the fresh engine (``load_gateway_cold``: none may be refused), then the same load
   through the gateway, straight to the api_server, and through a second gateway with the queue off,
   taking turns ``GPU_SMOKE_LOAD_ROUNDS`` times (3) on the warm engine (TTFT and end-to-end p50/p99 side
   by side, medians in ``load_warm_median``, with the backend's 8 batch slots full), and a client that drops a
   1,800-token stream after 4 chunks (the backend's running count must go back to 0 and it must
   generate fewer tokens than asked for). With ``GPU_SMOKE_STATE=1`` (the default) the admin
   listener's ``/admin/balancer`` is polled each second into ``balancer_state.jsonl``;
6. stops everything it started (SIGINT to the gateway, which stops its api_servers; then a bounded
   wait and SIGKILL for anything left) and writes, under ``$OUT`` (or ``$GPU_SMOKE_WORK/out``):
   ``summary.json`` (each check's status, latency and a snippet; versions), ``gateway.log``,
   ``api_server.log``, ``backend_metrics.txt``, ``gateway_metrics.txt`` (after the load),
   ``balancer_state.jsonl``, and ``vlm_server.log`` when a VLM was started.

``GPU_SMOKE_ENGINE=sim`` runs the same flow against the gateway's bundled simulator (no GPU, no
lmdeploy, no model build unless ``GPU_SMOKE_BUILD=1``): it checks the script itself.
``GPU_SMOKE_VLM=0`` leaves the VLM out. Exit status: 0 when every required check
passed, 1 otherwise.
"""

from __future__ import annotations

import base64
import io
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable

T0 = time.monotonic()
BUDGET = float(os.environ.get("GPU_SMOKE_BUDGET", "360"))  # seconds for the whole run, stop included
STOP_RESERVE = 45.0  # kept for stopping and writing the results
ENGINE = os.environ.get("GPU_SMOKE_ENGINE", "lmdeploy")
STATE_DUMP = os.environ.get("GPU_SMOKE_STATE", "1") == "1"  # diagnostics: /admin/balancer polled each second
LOAD = os.environ.get("GPU_SMOKE_LOAD", "1") == "1"  # the load and disconnect checks (optional ones)
LOAD_REQUESTS, LOAD_CONCURRENCY, LOAD_TOKENS = 96, 32, 64
LOAD_ROUNDS = int(os.environ.get("GPU_SMOKE_LOAD_ROUNDS", "3"))  # turns of the three paths on the warm engine
WANT_VLM = os.environ.get("GPU_SMOKE_VLM", "1") == "1" and ENGINE == "lmdeploy"
WORK = Path(os.environ.get("GPU_SMOKE_WORK", "/tmp/gpu_smoke"))
OUT = Path(os.environ.get("OUT") or (WORK / "out"))
MODEL_NAME = "tiny-chat"
VLM_NAME = "tiny-vlm"
REPO = Path(__file__).resolve().parent.parent

RESULTS: dict[str, Any] = {"engine": ENGINE, "checks": {}, "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
PROCS: list[subprocess.Popen] = []  # everything this script started, stopped in finally
SESSIONS: set[int] = set()  # process sessions this script started (its own children's, the launched instances')


def left() -> float:
    return BUDGET - (time.monotonic() - T0)


def say(msg: str) -> None:
    print(f"[smoke {time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def check(name: str, required: bool = True) -> Callable[[Callable[[], Any]], Any]:
    """Run fn now; record ok/fail, latency and a snippet of what it returned (or the error)."""

    def run(fn: Callable[[], Any]) -> Any:
        t = time.monotonic()
        entry: dict[str, Any] = {"required": required}
        try:
            if left() < STOP_RESERVE:
                raise TimeoutError(f"skipped: only {left():.0f}s of the budget left")
            result = fn()
            entry.update(ok=True, result=_snip(result))
        except Exception as exc:  # every check is recorded, none stops the run
            entry.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:1500])
            result = None
        entry["latency_s"] = round(time.monotonic() - t, 3)
        RESULTS["checks"][name] = entry
        say(f"{'PASS' if entry['ok'] else ('FAIL' if required else 'fail (optional)')} {name} ({entry['latency_s']}s): "
            f"{str(entry.get('result', entry.get('error')))[:300]}")
        return result

    return run


def _snip(value: Any) -> Any:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return value if len(text) <= 2000 else text[:2000] + "...(cut)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method: str, url: str, *, key: str | None = None, body: Any = None, timeout: float = 30.0) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("content-type", "application/json")
    if key:
        req.add_header("authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def tail(path: Path, lines: int = 15, max_bytes: int = 65536) -> str:
    try:
        with open(path, "rb") as f:
            end = f.seek(0, os.SEEK_END)
            f.seek(max(0, end - max_bytes))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join([line for line in text.splitlines() if line.strip()][-lines:])


def copy_tail(src: Path, dst: Path, max_bytes: int = 8 << 20) -> None:
    try:
        with open(src, "rb") as f:
            end = f.seek(0, os.SEEK_END)
            f.seek(max(0, end - max_bytes))
            dst.write_bytes(f.read())
    except OSError as exc:
        dst.write_text(f"(not available: {exc})\n")


# -- versions --------------------------------------------------------------------------------------
def versions() -> dict[str, Any]:
    from importlib import metadata

    out: dict[str, Any] = {"python": sys.version.split()[0], "executable": sys.executable}
    for name in ("torch", "triton", "transformers", "tokenizers", "lmdeploy", "lmdeploy-gateway", "openai", "fastapi",
                 "starlette", "uvicorn", "pydantic", "xgrammar", "apache-tvm-ffi", "pyzmq", "httpx", "aiohttp", "peft", "accelerate"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    try:
        out["nvidia-smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,memory.used,driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        out["nvidia-smi"] = f"unavailable: {exc}"
    return out


# -- tiny models -----------------------------------------------------------------------------------
CHATML = (
    "{% for message in messages %}"
    "{% if message['content'] is string %}{% set content = message['content'] %}"
    "{% else %}{% set content = '' %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{% set content = content + part['text'] %}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + content + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

WORDS = ("the a gateway model token stream cache engine request answer small random weight chat image hello world "
         "quick brown fox jumps over lazy dog python server client key route metric health ready batch queue").split()


def corpus(n: int = 4000) -> list[str]:
    import random

    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 16))) for _ in range(n)]
    lines += ["Hello! How are you? Say something: 0123456789 ,.;:!?'\"()[]{}<>-_=+/*&^%$#@~`|\\"] * 20
    return lines


def build_tokenizer(specials: list[str], vocab_size: int = 1024):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token=None, chat_template=CHATML, model_max_length=4096)


def build_text_model(path: Path) -> dict[str, Any]:
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tok = build_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    vocab = len(tok)
    cfg = Qwen2Config(
        vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=64, max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=False, rms_norm_eps=1e-6,
        bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"), eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
    )
    cfg.dtype = "bfloat16"
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    GenerationConfig(bos_token_id=cfg.bos_token_id, eos_token_id=[cfg.eos_token_id], pad_token_id=cfg.pad_token_id).save_pretrained(path)
    # Sanity: the template renders and the model runs one step on the CPU.
    ids = tok.apply_chat_template([{"role": "user", "content": "hello world"}], add_generation_prompt=True, return_dict=False)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([list(ids)])).logits
    return {"path": str(path), "vocab": vocab, "params": sum(p.numel() for p in model.parameters()), "prompt_tokens": len(ids),
            "logits_shape": list(logits.shape), "files": sorted(p.name for p in path.iterdir())}


def build_vlm(path: Path) -> dict[str, Any]:
    """A tiny random-weight Qwen2-VL (vision tower depth 1), its processor and chat template."""
    import torch
    from transformers import (GenerationConfig, Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessor,
                              Qwen2VLProcessor, Qwen2VLVideoProcessor)

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tok = build_tokenizer(specials)
    template = CHATML.replace(
        "{% if part['type'] == 'text' %}{% set content = content + part['text'] %}{% endif %}",
        "{% if part['type'] == 'text' %}{% set content = content + part['text'] %}"
        "{% elif part['type'] in ('image', 'image_url') %}{% set content = content + '<|vision_start|><|image_pad|><|vision_end|>' %}{% endif %}",
    )
    tok.chat_template = template
    ids = {t: tok.convert_tokens_to_ids(t) for t in specials}
    text = dict(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [16, 8, 8]}, tie_word_embeddings=False,
                bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
    vision = dict(depth=1, embed_dim=128, hidden_size=128, num_heads=2, mlp_ratio=2, in_channels=3, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2)
    cfg = Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
    # Older readers (lmdeploy's config parsing) look for the text fields at the top level too.
    for k, v in text.items():
        setattr(cfg, k, v)
    cfg.dtype = cfg.text_config.dtype = "bfloat16"
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(cfg).to(torch.bfloat16)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    image_proc = Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=224 * 224)
    proc = Qwen2VLProcessor(image_processor=image_proc, tokenizer=tok, video_processor=Qwen2VLVideoProcessor(), chat_template=template)
    proc.save_pretrained(path)
    tok.save_pretrained(path)
    GenerationConfig(bos_token_id=text["bos_token_id"], eos_token_id=[text["eos_token_id"]], pad_token_id=text["pad_token_id"]).save_pretrained(path)
    return {"path": str(path), "vocab": len(tok), "files": sorted(p.name for p in path.iterdir())}


def png_data_url(size: int = 64) -> str:
    """A small gradient PNG as a base64 data: URL (PIL when it is there, else zlib by hand)."""
    pixels = [[((x * 4) % 256, (y * 4) % 256, ((x + y) * 2) % 256) for x in range(size)] for y in range(size)]
    try:
        from PIL import Image

        img = Image.new("RGB", (size, size))
        img.putdata([p for row in pixels for p in row])
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        data = buf.getvalue()
    except ImportError:
        import struct
        import zlib

        def chunk(kind: bytes, body: bytes) -> bytes:
            return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)

        raw = b"".join(b"\x00" + bytes(c for p in row for c in p) for row in pixels)
        data = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", size, size, 8, 2, 0, 0, 0))
                + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))
    return "data:image/png;base64," + base64.b64encode(data).decode()


# -- processes -------------------------------------------------------------------------------------
def start(argv: list[str], log: Path, env: dict[str, str] | None = None, pass_fds: tuple[int, ...] = ()) -> subprocess.Popen:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=fd, stderr=subprocess.STDOUT, env=env, cwd=str(REPO),
                             start_new_session=True, pass_fds=pass_fds)
    finally:
        os.close(fd)
    PROCS.append(p)
    SESSIONS.add(p.pid)
    return p


def stop_all() -> dict[str, Any]:
    """SIGINT the gateway (it stops its api_servers), SIGTERM the rest; SIGKILL whatever is left."""
    report: dict[str, Any] = {}
    if PROCS and PROCS[0].poll() is None:
        note_sessions(PROCS[0].pid)  # the gateway's guards, before it goes
    for p in PROCS:
        if p.poll() is None:
            with _quiet():
                os.kill(p.pid, signal.SIGINT if p is PROCS[0] else signal.SIGTERM)
    deadline = time.monotonic() + min(30.0, max(5.0, left() - 10))
    for p in PROCS:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        report[f"pid{p.pid}"] = p.returncode if p.returncode is not None else "killed"
        with _quiet():
            os.killpg(p.pid, signal.SIGKILL)  # its process group: the guard's children included
        with _quiet():
            p.wait(timeout=5)
    # The launched instances (their own sessions, noted once ready) should be gone with the gateway.
    deadline = time.monotonic() + 10
    while session_members() and time.monotonic() < deadline:
        time.sleep(0.5)
    stray = session_members()
    report["stray_killed"] = stray
    for pid in stray:
        with _quiet():
            os.kill(pid, signal.SIGKILL)
    return report


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is not running
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


class _quiet:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> bool:
        return exc[0] is not None and issubclass(exc[0], (OSError, subprocess.SubprocessError))


# -- the run ---------------------------------------------------------------------------------------
def write_config(path: Path, model: Path, port: int, admin_port: int, hashes: dict[str, str]) -> str:
    if ENGINE == "sim":
        group = (f"  - model: {model}\n    model_name: {MODEL_NAME}\n    engine: sim\n    instances: 1\n    backend: pytorch\n"
                 "    session_len: 2048\n    max_batch_size: 8\n    sim: {ttft: 0.02, tpot: 0.002}\n")
    else:
        group = (f"  - model: {model}\n    model_name: {MODEL_NAME}\n    engine: lmdeploy\n    backend: pytorch\n    gpus: [0]\n    tp: 1\n"
                 "    cache_max_entry_count: 0.3\n    session_len: 2048\n    max_batch_size: 8\n    eager_mode: true\n"
                 "    extra_args: [--log-level, INFO]\n"
                 f"    start_timeout: {int(max(60, BUDGET - 60))}\n    max_restarts: 0\n")
    text = (
        f"server:\n  host: 127.0.0.1\n  port: {port}\n  log_level: info\n"
        f"state_dir: {WORK / 'state'}\n"
        "auth:\n  keys:\n"
        f"    - {{name: smoke, hash: \"{hashes['user']}\"}}\n"
        f"    - {{name: smoke-admin, hash: \"{hashes['admin']}\", admin: true}}\n"
        f"admin:\n  host: 127.0.0.1\n  port: {admin_port}\n  key_hash: \"{hashes['listener']}\"\n"
        "timeouts: {connect: 5, first_byte: 120, idle: 60, drain: 5}\n"
        f"launch:\n{group}"
    )
    path.write_text(text)
    return text


def wait_ready(gw: subprocess.Popen, base: str, admin: tuple[str, str], log_dir: Path, gateway_log: Path, limit: float) -> dict[str, Any]:
    deadline = time.monotonic() + limit
    last_print = 0.0
    last: Any = None
    while time.monotonic() < deadline:
        if gw.poll() is not None:
            raise RuntimeError(f"the gateway exited with {gw.returncode}; its log:\n{tail(gateway_log, 40)}")
        try:
            code, body = http("GET", base + "/ready", timeout=5)
            last = json.loads(body or b"{}")
            if code == 200:
                try:
                    rows = [b for b in _admin_backends(*admin) if b.get("origin") == "launched"]
                except AssertionError as exc:  # the admin listener said no: retried until the deadline
                    rows, last = [], repr(exc)
                if rows and all(b.get("available") for b in rows):
                    return {"ready": last, "launched": rows}
            if isinstance(last, dict) and last.get("failed_instances"):
                logs = "\n".join(f"--- {p.name}\n{tail(p, 40)}" for p in sorted(log_dir.glob("*.log")))
                raise RuntimeError(f"a launched instance failed: {last}\n{logs}")
        except (OSError, ValueError) as exc:
            last = repr(exc)
        if time.monotonic() - last_print > 15:
            last_print = time.monotonic()
            say(f"waiting for /ready ({deadline - time.monotonic():.0f}s left): {last}")
            for p in sorted(log_dir.glob("*.log")):
                say(f"  {p.name}:\n" + "\n".join("    " + line for line in tail(p, 6).splitlines()))
        time.sleep(1.0)
    raise TimeoutError(f"not ready in {limit:.0f}s; last /ready: {last}")


def main() -> int:
    shutil.rmtree(WORK, ignore_errors=True)
    (WORK / "state").mkdir(parents=True)
    OUT.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(REPO))
    RESULTS["versions"] = versions()
    say(f"engine={ENGINE} budget={BUDGET:.0f}s work={WORK} out={OUT} versions={json.dumps(RESULTS['versions'])}")
    from gateway.state.keys import hash_key, new_key

    keys = {"user": new_key(), "admin": new_key(), "listener": new_key()}
    hashes = {k: hash_key(v) for k, v in keys.items()}
    internal_key = secrets.token_hex(32)
    port, admin_port = free_port(), free_port()
    base, admin_base = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}"
    gateway_log, log_dir = WORK / "gateway.log", WORK / "state" / "logs"

    model = WORK / "tiny-chat"
    if ENGINE == "sim" and os.environ.get("GPU_SMOKE_BUILD") != "1":
        model.mkdir()
    elif check("build_text_model")(lambda: build_text_model(model)) is None:
        return 1
    if ENGINE == "sim" and os.environ.get("GPU_SMOKE_BUILD") == "1":  # the builders, checked without a GPU
        check("build_vlm", required=False)(lambda: build_vlm(WORK / "tiny-vlm"))

    cfg_text = write_config(WORK / "gateway.yaml", model, port, admin_port, hashes)
    RESULTS["config"] = cfg_text
    cc = subprocess.run([sys.executable, "-m", "gateway", "check-config", str(WORK / "gateway.yaml")], capture_output=True, text=True,
                        timeout=60, cwd=str(REPO))
    check("check_config")(lambda: cc.stdout.strip() if cc.returncode == 0 else (_ for _ in ()).throw(RuntimeError(cc.stderr.strip())))
    if cc.returncode != 0:
        return 1

    r, w = os.pipe()
    os.write(w, internal_key.encode())
    os.close(w)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    gw = start([sys.executable, "-m", "gateway", "serve", "--config", str(WORK / "gateway.yaml"), "--internal-key-fd", str(r)],
               gateway_log, env=env, pass_fds=(r,))
    os.close(r)
    PROCS.remove(gw)
    PROCS.insert(0, gw)  # stopped first, with SIGINT
    say(f"gateway pid {gw.pid} on {base}, admin listener {admin_base}")
    if STATE_DUMP:
        threading.Thread(target=poll_learnt, args=(admin_base, keys["listener"], WORK / "balancer_state.jsonl"), daemon=True).start()

    # The VLM: built and started by this script while the gateway's api_server loads; added to the pool
    # through the admin listener once healthy (after the text checks, so it can only cost its own checks).
    vlm: tuple[str, str] | None = None
    vlm_proc = None
    if WANT_VLM:
        built = check("build_vlm", required=False)(lambda: build_vlm(WORK / "tiny-vlm"))
        if built is not None:
            vlm_port, vlm_key = free_port(), secrets.token_hex(16)
            argv = [sys.executable, "-m", "lmdeploy", "serve", "api_server", str(WORK / "tiny-vlm"), "--server-name", "127.0.0.1",
                    "--server-port", str(vlm_port), "--model-name", VLM_NAME, "--backend", "pytorch", "--tp", "1",
                    "--cache-max-entry-count", "0.1", "--session-len", "4096", "--max-batch-size", "4", "--eager-mode", "--log-level", "INFO",
                    "--api-keys", vlm_key]
            vlm_proc = start(argv, WORK / "vlm_server.log", env=env)
            vlm = (f"http://127.0.0.1:{vlm_port}", vlm_key)
            RESULTS["vlm_argv"] = " ".join(argv[:-1]) + " ***"

    ready = check("ready")(lambda: wait_ready(gw, base, (admin_base, keys["listener"]), log_dir, gateway_log, max(30.0, left() - STOP_RESERVE - 90)))
    if ready is None:
        return 1

    backends = check("admin_backends")(lambda: _admin_backends(admin_base, keys["listener"]))
    try:
        code, body = http("GET", admin_base + "/admin/status", key=keys["listener"], timeout=10)
        RESULTS["admin_status"] = _snip(json.loads(body))
    except Exception as exc:
        RESULTS["admin_status"] = repr(exc)
    note_sessions(gw.pid)
    RESULTS["instance_sessions"] = sorted(SESSIONS)

    from openai import OpenAI

    client = OpenAI(base_url=base + "/v1", api_key=keys["user"], timeout=60.0, max_retries=0)
    messages = [{"role": "user", "content": "hello world, say something"}]

    def chat() -> dict[str, Any]:
        r = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=16, temperature=0.7)
        assert r.choices, "no choices"
        assert r.usage is not None and r.usage.total_tokens > 0, f"no usage: {r.usage}"
        return {"content": r.choices[0].message.content, "finish_reason": r.choices[0].finish_reason, "usage": r.usage.model_dump()}

    check("chat_completion")(chat)

    def stream() -> dict[str, Any]:
        t = time.monotonic()
        chunks, text, usage, finish, first = 0, "", None, None, None
        s = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=16, stream=True,
                                           stream_options={"include_usage": True})
        for c in s:
            chunks += 1
            if first is None:
                first = round(time.monotonic() - t, 3)
            if c.choices:
                text += c.choices[0].delta.content or ""
                finish = c.choices[0].finish_reason or finish
            if c.usage is not None:
                usage = c.usage.model_dump()
        assert chunks > 1, f"only {chunks} chunk(s)"
        assert finish is not None, "no finish_reason"
        return {"chunks": chunks, "first_chunk_s": first, "text": text, "finish_reason": finish, "usage": usage,
                "usage_present": usage is not None}

    check("chat_stream")(stream)

    image = png_data_url()

    def backend_requests(model_name: str) -> int:
        try:
            return sum(b.get("requests") or 0 for b in _admin_backends(admin_base, keys["listener"]) if model_name in b.get("models", []))
        except Exception:
            return -1

    def refusals() -> dict[str, int]:
        try:
            code, body = http("GET", admin_base + "/admin/status", key=keys["listener"], timeout=10)
            return json.loads(body)["refusals"]["by_reason"]
        except Exception:
            return {}

    def image_request(model_name: str, need_200: bool) -> Callable[[], dict[str, Any]]:
        """The image as a base64 data: URL; the gateway's media policy must let it through to the backend."""

        def go() -> dict[str, Any]:
            from openai import APIStatusError

            before, refused_before = backend_requests(model_name), refusals()
            content = [{"type": "text", "text": "describe this image"}, {"type": "image_url", "image_url": {"url": image}}]
            try:
                r = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": content}], max_tokens=8)
                out = {"status": 200, "content": r.choices[0].message.content if r.choices else None,
                       "usage": r.usage.model_dump() if r.usage else None}
            except APIStatusError as exc:  # recorded: what the gateway, or the backend behind it, said
                out = {"status": exc.status_code, "body": str(exc.body)[:800]}
            time.sleep(0.2)  # the stats are updated as the answer ends
            after, refused_after = backend_requests(model_name), refusals()
            out["forwarded_to_backend"] = after > before >= 0
            out["gateway_refusals"] = {k: v - refused_before.get(k, 0) for k, v in refused_after.items() if v != refused_before.get(k, 0)}
            assert out["forwarded_to_backend"], f"the gateway did not forward the image request: {out}"
            if need_200:
                assert out["status"] == 200, f"not answered: {out}"
            return out

        return go

    if vlm is not None:
        vlm_ready = check("vlm_added", required=False)(lambda: _add_vlm(admin_base, keys["listener"], vlm, vlm_proc))
        if vlm_ready is not None:
            check("image_request_vlm", required=False)(image_request(VLM_NAME, need_200=True))
    # The text model too: the gateway must forward a data: URL image; what a text-only backend answers is recorded.
    check("image_request_text_model")(image_request(MODEL_NAME, need_200=False))

    def models() -> list[str]:
        ids = sorted(m.id for m in client.models.list().data)
        assert MODEL_NAME in ids, ids
        return ids

    check("v1_models")(models)

    def expect(method: str, path: str, key: str | None, codes: tuple[int, ...], body: Any = None, url: str | None = None) -> Callable[[], Any]:
        def go() -> dict[str, Any]:
            code, data = http(method, (url or base) + path, key=key, body=body, timeout=15)
            assert code in codes, f"{method} {path}: {code} (wanted {codes}): {data[:300]!r}"
            return {"status": code, "body": data[:300].decode("utf-8", "replace")}
        return go

    chat_body = {"model": MODEL_NAME, "messages": messages, "max_tokens": 4}
    check("no_key_401")(expect("POST", "/v1/chat/completions", None, (401,), chat_body))
    check("bad_key_401")(expect("POST", "/v1/chat/completions", "sk-not-a-key", (401,), chat_body))
    check("terminate_refused")(expect("GET", "/terminate", keys["user"], (403, 404, 405)))
    check("terminate_post_refused")(expect("POST", "/terminate", keys["user"], (403, 404, 405), {}))
    check("nodes_add_refused")(expect("POST", "/nodes/add", keys["user"], (403, 404, 405), {"url": "http://127.0.0.1:1"}))
    check("gateway_metrics_plain_key_403")(expect("GET", "/metrics", keys["user"], (403,)))

    def gateway_metrics() -> dict[str, Any]:
        code, data = http("GET", base + "/metrics", key=keys["admin"], timeout=15)
        assert code == 200, code
        text = data.decode()
        (WORK / "gateway_metrics.txt").write_text(text)
        lines = [l for l in text.splitlines() if l.startswith("gateway_") and not l.startswith("#")]
        return {"status": code, "bytes": len(data), "sample": lines[:25]}

    check("gateway_metrics_admin_key")(gateway_metrics)

    urls = [b["url"] for b in (backends or []) if b.get("origin") == "launched"]
    if urls:
        if ENGINE != "sim":
            check("backend_metrics_no_key_401")(expect("GET", "/metrics", None, (401,), url=urls[0]))

        def backend_metrics() -> dict[str, Any]:
            from gateway.routing.signals import parse_metrics

            code, data = http("GET", urls[0] + "/metrics", key=internal_key, timeout=15)
            assert code == 200, f"{code}: {data[:300]!r}"
            text = data.decode("utf-8", "replace")
            (OUT / "backend_metrics.txt").write_text(text)
            parsed = parse_metrics(text)
            names = sorted({l.split("{")[0].split(" ")[0] for l in text.splitlines() if l and not l.startswith("#")})
            assert parsed, "parse_metrics found none of the series the balancer uses"
            return {"parsed": parsed, "series": len(names), "lmdeploy_series": [n for n in names if n.startswith("lmdeploy:")][:40]}

        check("backend_metrics_parsed")(backend_metrics)
    if urls and LOAD:
        direct = (urls[0], internal_key)
        # The first load on a fresh engine pays its warm-up (kernels compiled, first batches slow: 3 s on the
        # H200): the case in which the queue once refused most of a burst. It is kept and reported apart; then
        # the three paths take turns on the warm engine, LOAD_ROUNDS times, so that no path gets the cold
        # engine or the warmest one.
        check("load_gateway_cold", required=False)(lambda: load_run(base, keys["user"]))
        no_queue = check("gateway_no_queue_started", required=False)(lambda: start_without_queue(direct, hashes["user"], env))
        paths = {"gateway": (base, keys["user"]), "direct": direct}
        if no_queue is not None:
            paths["gateway_no_queue"] = (no_queue, keys["user"])
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in paths}
        for i in range(LOAD_ROUNDS):
            for name, (url, key) in paths.items():
                got = check(f"load_{name}_{i + 1}", required=False)(lambda url=url, key=key: load_run(url, key))
                if got is not None:
                    runs[name].append(got)
        RESULTS["load_warm_median"] = {name: _median_runs(rs) for name, rs in runs.items() if rs}
        say(f"warm engine, median of {LOAD_ROUNDS} rounds: {json.dumps(RESULTS['load_warm_median'])}")
        try:  # the queue's figures after the loads (sheds by reason, waits)
            code, data = http("GET", base + "/metrics", key=keys["admin"], timeout=15)
            (WORK / "gateway_metrics.txt").write_bytes(data)
        except Exception as exc:
            RESULTS["gateway_metrics_after_load"] = repr(exc)
        try:
            RESULTS["backends_after_load"] = _snip(_admin_backends(admin_base, keys["listener"]))
            code, body = http("GET", admin_base + "/admin/status", key=keys["listener"], timeout=10)
            RESULTS["admin_status_after_load"] = _snip(json.loads(body))
        except Exception as exc:
            RESULTS["backends_after_load"] = repr(exc)
        check("disconnect_aborts", required=False)(lambda: disconnect_run(base, keys["user"], direct))
    RESULTS["scrape_log_lines"] = [l for l in tail(gateway_log, 400).splitlines() if "scrap" in l.lower() or "signals" in l.lower()][-10:]
    return 0


def _pct(xs: list[float], q: float) -> float | None:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 4) if xs else None


def load_run(url: str, key: str) -> dict[str, Any]:
    """LOAD_REQUESTS streamed chats, LOAD_CONCURRENCY at a time (more than the backend's 8 batch slots, so
    requests queue somewhere): TTFT and end-to-end seconds as the client sees them."""
    import asyncio

    import httpx

    async def go() -> dict[str, Any]:
        ttfts: list[float] = []
        e2e: list[float] = []
        errors: list[str] = []
        sem = asyncio.Semaphore(LOAD_CONCURRENCY)
        limits = httpx.Limits(max_connections=LOAD_CONCURRENCY, max_keepalive_connections=LOAD_CONCURRENCY)
        async with httpx.AsyncClient(timeout=httpx.Timeout(60.0), limits=limits) as client:
            async def one(i: int) -> None:
                async with sem:
                    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": f"request {i}: tell me a long story"}],
                            "max_tokens": LOAD_TOKENS, "stream": True}
                    t0 = time.monotonic()
                    first = None
                    try:
                        async with client.stream("POST", url + "/v1/chat/completions", json=body,
                                                 headers={"Authorization": f"Bearer {key}"}) as r:
                            if r.status_code != 200:
                                errors.append(f"{r.status_code}: {(await r.aread())[:200]!r}")
                                return
                            async for line in r.aiter_lines():
                                if first is None and line.startswith("data: ") and '"content"' in line:
                                    first = time.monotonic() - t0
                        if first is not None:
                            ttfts.append(first)
                        e2e.append(time.monotonic() - t0)
                    except Exception as exc:
                        errors.append(f"{type(exc).__name__}: {exc}"[:200])

            t = time.monotonic()
            await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(LOAD_REQUESTS))), timeout=max(10.0, min(90.0, left() - STOP_RESERVE)))
            wall = time.monotonic() - t
        assert not errors, errors[:5]
        return {"requests": LOAD_REQUESTS, "concurrency": LOAD_CONCURRENCY, "max_tokens": LOAD_TOKENS, "wall_s": round(wall, 3),
                "req_per_s": round(LOAD_REQUESTS / wall, 2), "ttft_p50": _pct(ttfts, 0.5), "ttft_p99": _pct(ttfts, 0.99),
                "e2e_p50": _pct(e2e, 0.5), "e2e_p99": _pct(e2e, 0.99), "errors": len(errors)}

    return asyncio.run(go())


def start_without_queue(direct: tuple[str, str], user_hash: str, env: dict[str, str]) -> str:
    """A second gateway with the gateway queue off (every request bound at once), in front of the same
    api_server as a remote backend: which of the gateway's parts costs what. Returns its base URL; it stays
    up, idle between its loads, until stop_all stops it with the rest."""
    port = free_port()
    path = WORK / "gateway-no-queue.yaml"
    path.write_text(
        f"server:\n  host: 127.0.0.1\n  port: {port}\n  log_level: info\n"
        f"auth:\n  keys:\n    - {{name: smoke, hash: \"{user_hash}\"}}\n"
        "timeouts: {connect: 5, first_byte: 120, idle: 60, drain: 5}\n"
        "balancer: {queue: {enabled: false}}\n"
        f"backends:\n  - {{url: \"{direct[0]}\", name: direct, api_key: \"{direct[1]}\", models: [{MODEL_NAME}]}}\n"
    )
    start([sys.executable, "-m", "gateway", "serve", "--config", str(path)], WORK / "gateway-no-queue.log", env=env)
    base = f"http://127.0.0.1:{port}"
    t = time.monotonic()
    while time.monotonic() - t < 30:
        try:
            if http("GET", base + "/ready", timeout=2)[0] == 200:
                return base
        except Exception:
            pass
        time.sleep(0.2)
    raise TimeoutError("the gateway without the queue was not ready within 30 s")


def _median_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("req_per_s", "ttft_p50", "ttft_p99", "e2e_p50", "e2e_p99")
    out: dict[str, Any] = {"runs": len(runs), "errors": sum(r["errors"] for r in runs)}
    for k in keys:
        xs = sorted(r[k] for r in runs if r.get(k) is not None)
        out[k] = round((xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2, 4) if xs else None
    return out


def poll_learnt(admin_base: str, key: str, out: Path) -> None:
    """What the balancer and the queue have learnt (``/admin/balancer``), one JSON line a second."""
    t0 = time.monotonic()
    with open(out, "a") as f:
        while left() > 0:
            time.sleep(1.0)
            try:
                code, body = http("GET", admin_base + "/admin/balancer", key=key, timeout=2)
                line = {"t": round(time.monotonic() - t0, 2), **json.loads(body)} if code == 200 else {"status": code}
            except Exception as exc:
                line = {"error": repr(exc)}
            f.write(json.dumps(line) + "\n")
            f.flush()


def _backend_gauges(url: str, key: str) -> dict[str, float]:
    from gateway.routing.signals import parse_metrics

    code, data = http("GET", url + "/metrics", key=key, timeout=10)
    assert code == 200, code
    return parse_metrics(data.decode("utf-8", "replace"))


def disconnect_run(base: str, key: str, direct: tuple[str, str]) -> dict[str, Any]:
    """A client that goes away mid-stream: the gateway must abort the backend's request (its running count
    back to 0, and far fewer tokens generated than asked for)."""
    import http.client

    before = _backend_gauges(*direct)
    body = json.dumps({"model": MODEL_NAME, "messages": [{"role": "user", "content": "a very long answer please"}],
                       "max_tokens": 1800, "ignore_eos": True, "stream": True})
    host, port = base.split("//")[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", "/v1/chat/completions", body=body, headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.status
    got = b""
    t0 = time.monotonic()
    while got.count(b"data: ") < 4 and time.monotonic() - t0 < 20:
        got += resp.read1(4096)
    running_mid = _backend_gauges(*direct).get("lmdeploy:num_requests_running")
    conn.sock.close()  # the client disappears without a word
    conn.close()
    t_close = time.monotonic()
    running = None
    while time.monotonic() - t_close < 15:
        g = _backend_gauges(*direct)
        running = g.get("lmdeploy:num_requests_running")
        if running == 0:
            break
        time.sleep(0.1)
    settle = time.monotonic() - t_close
    time.sleep(1.0)
    after = _backend_gauges(*direct)
    generated = after.get("lmdeploy:generation_tokens_total", 0) - before.get("lmdeploy:generation_tokens_total", 0)
    out = {"chunks_read": got.count(b"data: "), "running_mid_stream": running_mid, "running_after": running,
           "seconds_to_idle": round(settle, 3), "tokens_generated": generated, "max_tokens": 1800}
    assert running == 0, f"the backend still runs the request: {out}"
    assert generated < 1800, f"generated all it was asked for: the request was not aborted: {out}"
    return out


def _admin_backends(admin_base: str, key: str) -> list[dict[str, Any]]:
    code, body = http("GET", admin_base + "/admin/backends", key=key, timeout=10)
    assert code == 200, f"{code}: {body[:300]!r}"
    return json.loads(body)["backends"]


def _add_vlm(admin_base: str, key: str, vlm: tuple[str, str], proc: subprocess.Popen | None) -> dict[str, Any]:
    """Wait for the VLM api_server's /health, then add it to the gateway's pool through the admin listener."""
    url, vlm_key = vlm
    deadline = time.monotonic() + max(10.0, left() - STOP_RESERVE - 45)
    last: Any = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the VLM api_server exited with {proc.returncode}:\n{tail(WORK / 'vlm_server.log', 30)}")
        try:
            last = http("GET", url + "/health", timeout=5)
            if last[0] == 200:
                break
        except OSError as exc:
            last = repr(exc)
        time.sleep(2)
    else:
        raise TimeoutError(f"VLM /health: {last}; log:\n{tail(WORK / 'vlm_server.log', 20)}")
    code, body = http("POST", admin_base + "/admin/backends", key=key, body={"url": url, "name": "vlm", "api_key": vlm_key, "models": [VLM_NAME]},
                      timeout=20)
    assert code == 201, f"POST /admin/backends: {code}: {body[:300]!r}"
    row = json.loads(body)
    deadline = time.monotonic() + 20
    while not row.get("available") and time.monotonic() < deadline:
        time.sleep(1)
        row = next((b for b in _admin_backends(admin_base, key) if b["id"] == "vlm"), row)
    assert row.get("available"), f"added but not available: {row}"
    return row


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, session id) of a process, from /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return fields[0], int(fields[1]), int(fields[3])
    except (OSError, IndexError, ValueError):
        return None


def _all_pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


def note_sessions(parent: int) -> None:
    """The sessions of the parent's children: each launched instance runs under a guard that is the leader of its own."""
    for pid in _all_pids():
        st = _stat(pid)
        if st and st[1] == parent:
            SESSIONS.add(st[2])


def session_members() -> list[int]:
    me = os.getpid()
    out = []
    for pid in _all_pids():
        st = _stat(pid)
        if st and pid != me and st[0] != "Z" and st[2] in SESSIONS:
            out.append(pid)
    return out


def finish(code: int) -> int:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the backstop's SIGTERM must not cut the clean-up short
    say("stopping")
    try:
        RESULTS["stop"] = stop_all()
    except Exception as exc:
        RESULTS["stop"] = f"error: {exc!r}"
    gateway_log, log_dir = WORK / "gateway.log", WORK / "state" / "logs"
    copy_tail(gateway_log, OUT / "gateway.log")
    logs = sorted(log_dir.glob("*.log")) if log_dir.is_dir() else []
    if logs:
        copy_tail(logs[0], OUT / "api_server.log")
    if (WORK / "vlm_server.log").exists():
        copy_tail(WORK / "vlm_server.log", OUT / "vlm_server.log")
    for name in ("balancer_state.jsonl", "gateway_metrics.txt"):
        if (WORK / name).exists():
            copy_tail(WORK / name, OUT / name, max_bytes=2 << 20)
    if not (OUT / "backend_metrics.txt").exists():
        (OUT / "backend_metrics.txt").write_text("(not read)\n")
    time.sleep(0.5)
    left_running = [p.pid for p in PROCS if _alive(p.pid)] + session_members()
    RESULTS["left_running"] = left_running
    failed = [n for n, c in RESULTS["checks"].items() if c["required"] and not c["ok"]]
    failed_optional = [n for n, c in RESULTS["checks"].items() if not c["required"] and not c["ok"]]
    RESULTS["passed"] = [n for n, c in RESULTS["checks"].items() if c["ok"]]
    RESULTS["failed_required"] = failed
    RESULTS["failed_optional"] = failed_optional
    RESULTS["ok"] = code == 0 and not failed and bool(RESULTS["checks"])
    RESULTS["elapsed_s"] = round(time.monotonic() - T0, 1)
    (OUT / "summary.json").write_text(json.dumps(RESULTS, indent=2, default=str))
    print("\n===== GPU smoke summary =====")
    for name, c in RESULTS["checks"].items():
        mark = "PASS" if c["ok"] else ("FAIL" if c["required"] else "fail*")
        print(f"{mark:5} {name:32} {c['latency_s']:8.3f}s  {str(c.get('result', c.get('error')))[:150]}")
    if "fatal" in RESULTS:
        print("fatal: " + RESULTS["fatal"].strip().splitlines()[-1])
    print(f"overall: {'OK' if RESULTS['ok'] else 'FAILED'} in {RESULTS['elapsed_s']}s; failed required: {failed}; "
          f"failed optional: {failed_optional}; left running: {left_running}; files in {OUT}: {sorted(p.name for p in OUT.iterdir())}")
    return 0 if RESULTS["ok"] else 1


def _on_term(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _on_term)
    rc = 1
    try:
        rc = main()
    except BaseException as exc:  # KeyboardInterrupt too: always stop and write the results
        RESULTS["fatal"] = "".join(traceback.format_exception(exc))[-4000:]
        say(f"fatal: {exc!r}")
        rc = 1
    sys.exit(finish(rc))
