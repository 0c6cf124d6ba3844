"""A tiny model directory and a real `wideserve serve` subprocess for the server tests.

The model is a 2-layer Llama with dummy weights (`--load-format dummy`) and a byte-level BPE
tokenizer trained here in milliseconds, with a chat template: everything the server path
touches, at a size that starts in seconds on a CPU.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

# Outside the kernel's ephemeral range, so nothing else is given them meanwhile
# (tests/ports.py; tests/ is put on the path for scripts that import this module).
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from ports import free_port  # noqa: E402,F401 - re-exported

VOCAB = 384
MAX_LEN = 256
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
_CORPUS = ("To be, or not to be, that is the question: whether 'tis nobler in the mind to "
           "suffer the slings and arrows of outrageous fortune, or to take arms against a sea "
           "of troubles and by opposing end them. The quick brown fox jumps over the lazy dog. "
           "Hello world, hello server, hello tokens. 0123456789 + - * / = ? ! ; : ")


def write_tiny_model(path: Path, max_len: int = MAX_LEN) -> Path:
    """`max_len`: the model's context; a test that must signal a server while a stream is
    still running asks for a long one (a 200-token stream of this model can end within
    0.15 s of its first chunk, sooner than a loaded machine wakes the test's thread)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 32, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([_CORPUS] * 20, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True,
        "chat_template": CHAT_TEMPLATE}))
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": max_len, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "torch_dtype": "float32",
        "bos_token_id": 0, "eos_token_id": 1}))
    return path




def server_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    return env


class RemoteServer:
    """`python -m wideserve.entrypoints.cli serve ...` on a free port, until close()."""

    def __init__(self, args: list[str], *, startup_timeout: float = 180.0,
                 new_session: bool = False, log_level: str = "warning") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "wideserve.entrypoints.cli", "serve", *args,
               "--port", str(self.port), "--log-level", log_level]
        # A file, not a pipe: a chatty server must never block on a full pipe buffer.
        self.log = tempfile.NamedTemporaryFile("w+", prefix="wideserve-server-", suffix=".log")
        # new_session: its own process group, so a test can signal the group like Ctrl-C.
        self.proc = subprocess.Popen(cmd, env=server_env(), stdout=self.log,
                                     stderr=subprocess.STDOUT, text=True,
                                     start_new_session=new_session)
        try:
            self._wait_ready(startup_timeout)
        except BaseException:
            self.close()
            raise

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("server exited during startup:\n" + self.read_output())
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError("server not healthy in time:\n" + self.read_output())

    def read_output(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def engine_pid(self) -> int:
        """The engine-core child of the server process (via /proc: no psutil needed)."""
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == self.proc.pid and b"wideserve.engine.engine_proc" in cmdline:
                return int(entry.name)
        raise LookupError("no engine-core child process found")

    def close(self, sig: int = signal.SIGTERM, timeout: float = 30.0,
              group: bool = False) -> int:
        if self.proc.poll() is None:
            if group:
                os.killpg(self.proc.pid, sig)
            else:
                self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def served(request, srv: RemoteServer):
    """Module-fixture body: yield the server, close it, and show its log if a test failed."""
    failed_before = request.session.testsfailed
    yield srv
    code = srv.close()
    if request.session.testsfailed > failed_before or code != 0:
        print(f"--- server log (exit code {code}) ---\n" + srv.read_output()[-20000:])
    assert code == 0
