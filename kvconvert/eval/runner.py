"""Model runners: one small interface over the engines that `kvconvert validate` can drive.

    runner = make_runner(folder, engine="runtime" | "transformers", kv_dtype="auto")
    runner.logits(ids)                  # ids: LongTensor [T]  -> fp32 logits [T, vocab]
    runner.greedy(ids, max_new_tokens, stop_ids)   # -> list[int], new tokens, stop token excluded

- TransformersRunner: AutoModelForCausalLM from the folder in fp32, no remote code, its own
  greedy loop (argmax, KV cache, no generation_config knobs such as repetition penalty).
  It keeps K/V in fp32: a quantized KV cache is not available there unless kvconvert.quant
  provides a fake-quant cache (see `_fake_quant_cache_factory`).
- RuntimeRunner: kvconvert.runtime.LLM (the bundled paged-KV engine). Logits go through its
  paged path (`LLM.score`) and KV is stored like an engine stores it (bf16, fp8 with scales,
  nvfp4), so this is the engine that measures a quantized-KV candidate.

Every runner has a `fingerprint`: a hash of the checkpoint's content (manifest.json file hashes,
or config + weight file names/sizes/mtimes when there is no manifest) plus the engine and KV
format. Cached per-sample results are keyed by it.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch

from kvconvert.errors import CheckpointError, KVConvertError, UnsupportedModelError

ENGINES = ("runtime", "transformers")
# "auto" = the engine's own unquantized cache (runtime: bf16, transformers: fp32).
KV_DTYPE_CHOICES = ("auto", "bf16", "fp16", "fp32", "fp8", "fp8_e4m3", "fp8_e5m2", "nvfp4")
QUANTIZED_KV = ("fp8", "fp8_e4m3", "fp8_e5m2", "nvfp4")
PROBE_TEXT = "KV caches: 128K tokens in FP8 & NVFP4, see https://x.io/a_b?c=1 — naïve café 東京 <tag>\n\tend."


# --------------------------------------------------------------------------- fingerprints

def checkpoint_fingerprint(folder: Path) -> str:
    """Content hash of a checkpoint folder, 16 hex chars.

    With manifest.json (written by kvconvert's CheckpointWriter): sha256 of its per-file sha256
    list, so a byte-identical re-export gets the same fingerprint. Without one: config.json's
    bytes plus each weight file's name, size and mtime (cheap; a rewritten file changes it).
    """
    folder = Path(folder)
    digest = hashlib.sha256()
    manifest = folder / "manifest.json"
    if manifest.is_file():
        try:
            files = json.loads(manifest.read_text())["files"]
            digest.update(json.dumps({k: v["sha256"] for k, v in sorted(files.items())}).encode())
            return digest.hexdigest()[:16]
        except (OSError, json.JSONDecodeError, KeyError, TypeError):
            digest = hashlib.sha256()  # unreadable manifest: fall back to file stats
    config = folder / "config.json"
    if not config.is_file():
        raise CheckpointError(f"{folder}: config.json not found; expected a Hugging Face model folder")
    digest.update(config.read_bytes())
    for path in sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.json")):
        stat = path.stat()
        digest.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


def eos_token_ids(folder: Path) -> tuple[int, ...]:
    """EOS ids named by config.json and generation_config.json (int or list in either)."""
    found: list[int] = []
    for name in ("config.json", "generation_config.json"):
        path = Path(folder) / name
        if not path.is_file():
            continue
        try:
            eos = json.loads(path.read_text()).get("eos_token_id")
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(eos, int):
            found.append(eos)
        elif isinstance(eos, list):
            found.extend(int(e) for e in eos)
    return tuple(dict.fromkeys(found))


def load_tokenizer(folder: Path):
    """The folder's own tokenizer (AutoTokenizer, no remote code); clear error when absent."""
    from transformers import AutoTokenizer

    folder = Path(folder)
    if not any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise CheckpointError(
            f"{folder}: no tokenizer files (tokenizer.json / tokenizer_config.json); copy them from the source model")
    try:
        return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
    except Exception as exc:  # transformers raises many error types here
        raise CheckpointError(f"{folder}: cannot load its tokenizer ({type(exc).__name__}: {exc})") from None


def check_same_tokenizer(source_tok, candidate_tok, source: Path, candidate: Path) -> None:
    """Source and candidate must tokenize identically, or no comparison is meaningful."""
    if len(source_tok) != len(candidate_tok):
        raise KVConvertError(
            f"tokenizers differ: {source} has {len(source_tok)} tokens, {candidate} has {len(candidate_tok)}; "
            "validate a candidate converted from this source (copy the source's tokenizer files)")
    a = source_tok(PROBE_TEXT, add_special_tokens=False).input_ids
    b = candidate_tok(PROBE_TEXT, add_special_tokens=False).input_ids
    if a != b:
        raise KVConvertError(
            f"tokenizers differ: a probe string tokenizes to {len(a)} ids with {source} and {len(b)} with "
            f"{candidate} (first difference at position "
            f"{next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))}); "
            "validate a candidate converted from this source (copy the source's tokenizer files)")


# --------------------------------------------------------------------------- runners

def resolve_kv_dtype(engine: str, kv_dtype: str) -> str:
    """The KV format a runner will really use; errors for combinations an engine cannot run."""
    if kv_dtype not in KV_DTYPE_CHOICES:
        raise KVConvertError(f"--kv-dtype {kv_dtype!r} is unknown; choose one of {', '.join(KV_DTYPE_CHOICES)}")
    if engine == "transformers":
        if kv_dtype not in ("auto", "fp32"):
            raise KVConvertError(
                f"--kv-dtype {kv_dtype} is not supported with --engine transformers (it keeps K/V in fp32 and "
                "kvconvert.quant provides no fake-quant cache); use --engine runtime, which stores KV like an engine")
        return "fp32"
    return "bf16" if kv_dtype == "auto" else kv_dtype


def runner_fingerprint(path: Path, engine: str, kv_dtype: str, kv_scales: str) -> str:
    """16 hex chars naming (checkpoint content, engine, KV format, KV scale source)."""
    key = f"{checkpoint_fingerprint(path)}|{engine}|kv={kv_dtype}"
    if engine == "runtime" and kv_dtype in QUANTIZED_KV:
        key += f"|scales={kv_scales}"
    return hashlib.sha256(key.encode()).hexdigest()[:16]


class ModelRunner:
    """Interface shared by the engines.

    Attributes: path, engine, kv_dtype (resolved), max_context (longest sequence it can run),
    vocab_size, fingerprint. Methods: logits, greedy, close.
    """

    engine = "abstract"

    def __init__(self, path: Path, kv_dtype: str, kv_scales: str = "checkpoint"):
        self.path = Path(path)
        self.kv_dtype = resolve_kv_dtype(self.engine, kv_dtype)
        self.kv_scales = kv_scales
        self.config = json.loads((self.path / "config.json").read_text())
        self.max_context = int(self.config.get("max_position_embeddings") or 2048)
        self.vocab_size = int(self.config["vocab_size"])
        self.fingerprint = runner_fingerprint(self.path, self.engine, self.kv_dtype, kv_scales)

    def describe(self) -> dict:
        return {"path": str(self.path), "engine": self.engine, "kv_dtype": self.kv_dtype,
                "fingerprint": self.fingerprint, "architecture": (self.config.get("architectures") or ["?"])[0]}

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: int64 [T] -> fp32 logits [T, vocab]; row t predicts token t+1."""
        raise NotImplementedError

    def greedy(self, ids: torch.Tensor, max_new_tokens: int, stop_ids: tuple[int, ...]) -> list[int]:
        """Greedy continuation of ids [T]: at most max_new_tokens ids, ending before a stop id."""
        raise NotImplementedError

    def close(self) -> None:
        """Release the model's memory."""


class TransformersRunner(ModelRunner):
    """Hugging Face transformers in fp32 on CPU (architectures transformers knows natively, e.g.
    Llama and DeepseekV3); K/V stay fp32."""

    engine = "transformers"

    def __init__(self, path: Path, kv_dtype: str = "auto", kv_scales: str = "checkpoint"):
        super().__init__(path, kv_dtype, kv_scales)
        from transformers import AutoModelForCausalLM

        try:
            self.model = AutoModelForCausalLM.from_pretrained(
                str(self.path), dtype=torch.float32, trust_remote_code=False)
        except (ValueError, KeyError, OSError) as exc:
            raise UnsupportedModelError(
                f"{self.path}: transformers cannot load this checkpoint ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0][:200]})") from None
        self.model.eval()

    @torch.inference_mode()
    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=ids.reshape(1, -1), use_cache=False)
        return out.logits[0].float()

    @torch.inference_mode()
    def greedy(self, ids: torch.Tensor, max_new_tokens: int, stop_ids: tuple[int, ...]) -> list[int]:
        if max_new_tokens <= 0:
            return []
        from transformers import DynamicCache

        # logits_to_keep=1: only the last position's logits (skips a [T, vocab] lm_head product).
        out = self.model(input_ids=ids.reshape(1, -1), past_key_values=DynamicCache(), use_cache=True,
                         logits_to_keep=1)
        new: list[int] = []
        while True:
            token = int(out.logits[0, -1].argmax())
            if token in stop_ids:
                break
            new.append(token)
            if len(new) == max_new_tokens:
                break
            out = self.model(input_ids=torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
        return new

    def close(self) -> None:
        del self.model


class RuntimeRunner(ModelRunner):
    """kvconvert.runtime.LLM: the bundled paged-KV engine. Prefix caching is off and one
    sequence runs at a time, so every sample is computed the same way whatever ran before it."""

    engine = "runtime"

    def __init__(self, path: Path, kv_dtype: str = "auto", kv_scales: str = "checkpoint",
                 attention_backend: str = "torch"):
        super().__init__(path, kv_dtype, kv_scales)
        from kvconvert.runtime import LLM

        self.llm = LLM(str(self.path), kv_dtype=self.kv_dtype, kv_scales=kv_scales,
                       attention_backend=attention_backend, enable_prefix_caching=False, max_num_seqs=1)
        self.max_context = int(self.llm.max_model_len)

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        return self.llm.score(ids.reshape(-1).tolist()).float()

    def greedy(self, ids: torch.Tensor, max_new_tokens: int, stop_ids: tuple[int, ...]) -> list[int]:
        if max_new_tokens <= 0:
            return []
        from kvconvert.runtime import SamplingParams

        params = SamplingParams(max_tokens=max_new_tokens, greedy=True, ignore_eos=True,
                                stop_token_ids=tuple(stop_ids))
        (out,) = self.llm.generate([ids.reshape(-1).tolist()], params)
        if out.error:
            raise KVConvertError(f"{self.path}: the runtime could not run a {ids.numel()}-token prompt: {out.error}")
        tokens = list(out.token_ids)
        while tokens and tokens[-1] in stop_ids:  # the engine may return the stop token itself
            tokens.pop()
        return tokens

    def close(self) -> None:
        del self.llm


def runtime_available() -> str | None:
    """None when kvconvert.runtime.LLM imports, else the reason it does not."""
    try:
        from kvconvert.runtime import LLM  # noqa: F401
    except Exception as exc:  # any import-time failure of a module still being built
        return f"{type(exc).__name__}: {exc}"
    return None


def resolve_engine(engine: str | None) -> str:
    """'runtime' or 'transformers'. None/'auto' = runtime when it imports, else transformers
    (with a printed note)."""
    if engine in (None, "auto"):
        reason = runtime_available()
        if reason is None:
            return "runtime"
        print(f"note: kvconvert.runtime is not importable ({reason}); using --engine transformers",
              file=sys.stderr)
        return "transformers"
    if engine not in ENGINES:
        raise KVConvertError(f"--engine {engine!r} is unknown; choose runtime or transformers")
    if engine == "runtime":
        reason = runtime_available()
        if reason is not None:
            raise KVConvertError(
                f"--engine runtime: kvconvert.runtime cannot be imported ({reason}); use --engine transformers")
    return engine


RUNNERS = {"transformers": TransformersRunner, "runtime": RuntimeRunner}


class LazyRunner:
    """A runner that loads its model on first use, so a run whose results are all cached loads
    nothing. path, engine, kv_dtype, max_context, vocab_size and fingerprint are known up front."""

    def __init__(self, path: Path, engine: str, kv_dtype: str = "auto", kv_scales: str = "checkpoint"):
        if engine not in RUNNERS:
            raise KVConvertError(f"--engine {engine!r} is unknown; choose runtime or transformers")
        self.path, self.engine, self.kv_scales = Path(path), engine, kv_scales
        self.kv_dtype = resolve_kv_dtype(engine, kv_dtype)
        self.config = json.loads((self.path / "config.json").read_text())
        self.max_context = int(self.config.get("max_position_embeddings") or 2048)
        self.vocab_size = int(self.config["vocab_size"])
        self.fingerprint = runner_fingerprint(self.path, engine, self.kv_dtype, kv_scales)
        self._runner: ModelRunner | None = None

    @property
    def loaded(self) -> ModelRunner:
        if self._runner is None:
            self._runner = RUNNERS[self.engine](self.path, self.kv_dtype, self.kv_scales)
        return self._runner

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        return self.loaded.logits(ids)

    def greedy(self, ids: torch.Tensor, max_new_tokens: int, stop_ids: tuple[int, ...]) -> list[int]:
        return self.loaded.greedy(ids, max_new_tokens, stop_ids)

    def describe(self) -> dict:
        return {"path": str(self.path), "engine": self.engine, "kv_dtype": self.kv_dtype,
                "fingerprint": self.fingerprint, "architecture": (self.config.get("architectures") or ["?"])[0]}

    def close(self) -> None:
        if self._runner is not None:
            self._runner.close()
            self._runner = None
