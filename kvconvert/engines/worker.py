"""A stock engine in its own process, answering one JSON line per JSON request line (the engines' workers).

kvconvert.engines.vllm (vLLM in its own venv) and kvconvert.engines.llamacpp (llama.cpp's C API, whose
failed assertions abort the process) share this client: start the worker with a CONFIG.json, wait for its
"ready" line, send requests, read answers with a timeout, and turn a dead, silent or refusing worker into a
KVConvertError that ends with the worker's own last words from its log.
"""

from __future__ import annotations

import abc
import json
import os
import select
import subprocess
import tempfile
from pathlib import Path

from kvconvert.errors import KVConvertError


class WorkerProcess(abc.ABC):
    """One worker process. Subclasses give `command(config_path)`, `who` (how messages name the worker, e.g.
    "vLLM worker for MODEL") and `is_verdict(line)` (the log lines that say why it failed, e.g. its own
    "vllm_worker: ..." line or llama.cpp's GGML_ASSERT). The log (the engine's output) goes to `log_path`.
    timeout: seconds to wait for any one answer (the load included) before the worker is killed."""

    who = "worker"

    def __init__(self, config: dict, prefix: str, log_name: str, log_path: str | os.PathLike | None = None,
                 timeout: float = 1800.0):
        self.config = config
        self._tmp = tempfile.TemporaryDirectory(prefix=prefix)
        self.log_path = Path(log_path) if log_path else Path(self._tmp.name) / log_name
        self.timeout = timeout
        self.proc: subprocess.Popen | None = None
        self._log = None

    @abc.abstractmethod
    def command(self, config_path: Path) -> list[str]:
        """The worker's command line (its engine's python, reading `config_path`)."""

    @abc.abstractmethod
    def start(self):
        """Start the worker (start_process) and check its "ready" answer; returns self."""

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def is_verdict(self, line: str) -> bool:
        return False

    @property
    def scratch(self) -> Path:
        """A folder that lives as long as this client (files exchanged with the worker)."""
        return Path(self._tmp.name)

    def start_process(self) -> dict:
        """Start the worker and return its first answer (the "ready" line)."""
        config_path = self.scratch / "config.json"
        config_path.write_text(json.dumps(self.config))
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.command(config_path), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, text=True, bufsize=1)
        try:
            return self._read()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.stdin and not self.proc.stdin.closed:
                try:
                    self.proc.stdin.close()  # EOF: the worker ends its loop and exits
                except BrokenPipeError:
                    pass
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None
        self._tmp.cleanup()

    def _read(self) -> dict:
        # One answer is outstanding at a time, so nothing is left buffered between answers and
        # select() on the pipe tells whether the next line has started to arrive.
        ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout)
        if not ready:
            tail = self.log_tail()
            self.proc.kill()
            self.close()
            raise KVConvertError(f"{self.who} gave no answer in {self.timeout:.0f} s; killed {tail}")
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
            raise KVConvertError(f"{self.who} ended ({how}) {self.log_tail()}")
        return json.loads(line)

    def log_tail(self, lines: int = 15) -> str:
        """The worker's verdict lines when it wrote any (the last few), else the log's last `lines` lines."""
        if self._log is not None:
            self._log.flush()
        text = self.log_path.read_text(errors="replace").strip().splitlines() if self.log_path.is_file() else []
        verdicts = [ln for ln in text if self.is_verdict(ln)]
        tail = verdicts[-4:] if verdicts else text[-lines:]
        # a log in this client's scratch folder is gone once the client closes: quote it, do not name it
        where = f"{self.who}'s log" if self.log_path.parent == self.scratch else f"log {self.log_path}"
        return f"({where}):\n" + "\n".join(tail)

    def send(self, op: str, **fields) -> dict:
        """Send one request and return the worker's answer as it is (it may hold "error")."""
        if self.proc is None:
            raise KVConvertError(f"the {self.who} is not running (not started, or ended after an error)")
        try:
            self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # the worker died; _read says why
        return self._read()
