"""The user-facing engine: `LLM(model_path).generate(prompts, SamplingParams(...))`.

    from kvconvert.runtime import LLM, SamplingParams
    llm = LLM("path/to/hf-folder", kv_dtype="fp8", attention_backend="torch")
    outs = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16, greedy=True))
    logits = llm.score(token_ids)          # [T, vocab] fp32, through the paged path

device ("auto": cuda when torch sees a GPU, else cpu; kvconvert.device) holds the weights (copied
tensor by tensor from the mapped files), the paged KV cache and every step's tensors; "triton"
runs the compiled kernels on cuda and Triton's interpreter on the CPU (TRITON_INTERPRET=1).

Weights run in the dtype the checkpoint stores (`dtype=None`/"auto": a bf16 checkpoint stays bf16,
its tensors views of the memory-mapped safetensors files, so loading copies nothing) or in
"bf16"/"fp16"/"fp32" on request (converted copies). Before reading any weight the engine estimates
weights + KV pool + one step's activations from config.json (kvconvert.runtime.memory, kvconvert.memory) and
refuses with a KVConvertError naming the option that would fit.

Requests run with continuous batching over a paged KV cache; a request that cannot run (empty,
too long for the context, too big for the block pool) comes back with `error` set and
finish_reason "error" while the others complete.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from kvconvert.checkpoint import CheckpointReader, eos_token_ids, load_tokenizer
from kvconvert.device import resolve_device
from kvconvert.errors import KVConvertError
from kvconvert.runtime.attention import make_attention
from kvconvert.runtime.block_manager import BlockManager
from kvconvert.runtime.config import DEFAULT_KV_MEMORY, EngineConfig, SamplingParams
from kvconvert.runtime.kv_cache import PagedKVCache, bytes_per_token, decoded_bytes_per_token, read_kv_scales
from kvconvert.memory import check_memory, resolve_dtype
from kvconvert.runtime.memory import estimate_memory
from kvconvert.runtime.model_runner import ModelRunner
from kvconvert.runtime.models import kv_layout, load_model, stored_dtype
from kvconvert.runtime.scheduler import Scheduler
from kvconvert.runtime.sequence import Sequence


@dataclass
class Output:
    """One finished request. token_ids: generated tokens only (prompt excluded)."""

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str  # "stop" | "length" | "error"
    error: str | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0
    time_to_first_token_s: float | None = None
    latency_s: float | None = None


class LLM:
    def __init__(self, model_path, dtype: torch.dtype | str | None = None, device: str = "auto", **engine):
        """engine: EngineConfig's settings (kv_dtype, kv_scales, attention_backend, block_size, num_blocks,
        kv_memory, max_num_seqs, max_num_batched_tokens, max_model_len, enable_prefix_caching, decoded_copy)."""
        self.config = cfg = EngineConfig(**engine)
        self.model_path = Path(model_path)
        self.device = resolve_device(device)
        reader = CheckpointReader(model_path)
        layout = kv_layout(reader.config)  # an unsupported architecture fails here, before any weight is read
        self.attention = make_attention(cfg.attention_backend, cfg.kv_dtype, self.device)
        self.max_model_len = self._max_model_len(reader.config)
        self.kv_bytes_per_token = bytes_per_token(layout, cfg.kv_dtype)
        self.num_blocks = self._num_blocks()
        self.dtype = resolve_dtype(dtype, stored_dtype(reader))
        self._check_memory(reader.config)
        self.model = load_model(reader, dtype=self.dtype, max_positions=self.max_model_len, device=self.device)
        scales, dynamic = read_kv_scales(reader, layout, cfg.kv_dtype, cfg.kv_scales)
        self.cache = PagedKVCache(layout, self.num_blocks, cfg.block_size, cfg.kv_dtype, scales, dynamic, self.device,
                                  decoded_dtype=self.dtype if cfg.decoded_copy else None)  # none for a 16-bit cache
        self.block_manager = BlockManager(self.num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        eos = tuple(eos_token_ids(self.model_path, reader.config))
        self.scheduler = Scheduler(self.config, self.block_manager, self.max_model_len, self.model.vocab_size, eos)
        self.runner = ModelRunner(self.model, self.cache, self.block_manager, self.attention, eos)
        self._tokenizer = None
        self._next_id = 0
        self._finished: dict[int, Sequence] = {}
        reader.close()

    # ---------------------------------------------------------------- setup helpers
    def memory_estimate(self, config: dict, dtype: torch.dtype):
        """What this engine needs with weights in `dtype` (kvconvert.runtime.memory)."""
        cfg = self.config
        decoded = decoded_bytes_per_token(kv_layout(config), cfg.kv_dtype, dtype) if cfg.decoded_copy else 0
        per_token = self.kv_bytes_per_token + decoded
        return estimate_memory(config, dtype, kv_cache_bytes=self.num_blocks * cfg.block_size * per_token,
                               tokens_per_step=min(cfg.max_num_batched_tokens, self.max_model_len),
                               context=self.max_model_len)

    def _check_memory(self, config: dict) -> None:
        """Refuse before reading any weight when the model, its KV pool and one step cannot fit."""
        need = self.memory_estimate(config, self.dtype)
        hints = []
        if self.dtype == torch.float32:
            hints.append(("--dtype bf16 (dtype=torch.bfloat16)", self.memory_estimate(config, torch.bfloat16)))
        if need.kv_cache > 1 << 28:
            hints.append(("a smaller KV pool (--kv-memory 256M)", replace(need, kv_cache=1 << 28)))
        check_memory(need, f"{self.model_path.name} in {str(self.dtype).removeprefix('torch.')}", hints, self.device)

    def _max_model_len(self, config: dict) -> int:
        limit = config.get("max_position_embeddings")
        wanted = self.config.max_model_len
        if limit is None and wanted is None:
            raise KVConvertError("config.json has no max_position_embeddings; pass max_model_len")
        if wanted is not None and limit is not None and wanted > limit:
            raise KVConvertError(
                f"max_model_len {wanted} exceeds the model's max_position_embeddings {limit}; lower it"
            )
        return wanted or limit

    def _num_blocks(self) -> int:
        cfg = self.config
        block_bytes = self.kv_bytes_per_token * cfg.block_size
        if cfg.num_blocks is not None:
            return cfg.num_blocks
        if cfg.kv_memory is not None:
            n = cfg.kv_memory // block_bytes
            if n == 0:
                raise KVConvertError(
                    f"kv_memory {cfg.kv_memory} bytes holds no block of {cfg.block_size} tokens "
                    f"({block_bytes} bytes); give more KV memory"
                )
            return n
        useful = cfg.max_num_seqs * -(-self.max_model_len // cfg.block_size)
        return max(1, min(DEFAULT_KV_MEMORY // block_bytes, useful))

    @property
    def tokenizer(self):
        """The model folder's tokenizer (kvconvert.checkpoint.load_tokenizer: a KVConvertError when it
        has none or it does not load; pass token ids instead of text then)."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.model_path)
        return self._tokenizer

    # ---------------------------------------------------------------- requests
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    want_prompt_logits: bool = False, logits_from: int = 0) -> int:
        """Queue one request (it joins the next step); returns its request id. want_prompt_logits: keep the logits
        of the prompt positions from logits_from on (the positions before it may come from the prefix cache)."""
        params = params or SamplingParams()
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) and prompt else prompt
        if isinstance(token_ids, str):  # the empty string
            token_ids = []
        try:
            seq = Sequence(self._next_id, list(token_ids), params, want_prompt_logits=want_prompt_logits,
                           logits_from=logits_from)
        except ValueError as exc:
            raise KVConvertError(str(exc)) from None
        if params.seed is not None:
            seq.generator = torch.Generator().manual_seed(params.seed)
        self._next_id += 1
        self.scheduler.add(seq)
        return seq.seq_id

    def step(self) -> list[Sequence]:
        """Run one engine step; returns the sequences that finished in it (errors included).
        Their Outputs wait for take_output(request_id) (generate / stream / score collect their own)."""
        out = self.scheduler.schedule()
        finished = list(out.rejected)
        if out.scheduled:
            next_tokens = self.runner.run(out)
            finished += self.scheduler.update(out, next_tokens)
        elif not out.rejected and self.scheduler.has_work():
            raise RuntimeError("scheduler made no progress (bug: a request that fits alone was not scheduled)")
        for seq in finished:
            self._finished[seq.seq_id] = seq
        return finished

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def prompt_computed(self, request_id: int) -> bool:
        """True once the request's whole prompt is in the cache (it decodes) or it finished."""
        if request_id in self._finished:
            return True
        seq = next((s for s in self.scheduler.running if s.seq_id == request_id), None)
        return seq is not None and seq.num_computed_tokens >= seq.num_prompt_tokens

    def take_output(self, request_id: int) -> Output | None:
        """The Output of a finished request (added with add_request), once; None if not finished."""
        seq = self._finished.pop(request_id, None)
        return None if seq is None else self._output(seq)

    # ---------------------------------------------------------------- high-level API
    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None) -> list[Output]:
        """prompts: a string, a list of strings, or a list of token-id lists -> one Output each, in order."""
        prompts = _as_prompt_list(prompts)
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise KVConvertError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params_list)]
        pending = set(ids)
        while pending:
            self.step()
            pending -= self._finished.keys()
        return [self._output(self._finished.pop(i)) for i in ids]

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None):
        """Yield generated token ids as they are produced; finally return the Output (StopIteration.value)."""
        rid = self.add_request(prompt, params)
        sent = 0
        while rid not in self._finished:
            self.step()
            seq = self._finished.get(rid) or next((s for s in self.scheduler.running if s.seq_id == rid), None)
            if seq is not None:
                new = seq.output_token_ids[sent:]
                sent += len(new)
                yield from new
        return self._output(self._finished.pop(rid))

    def take_scores(self, request_id: int) -> torch.Tensor | None:
        """The prompt logits [T - logits_from, vocab] fp32 of a finished want_prompt_logits request, once; None if
        not finished. Raises KVConvertError if it could not run."""
        seq = self._finished.pop(request_id, None)
        if seq is None:
            return None
        if seq.error:
            raise KVConvertError(seq.error)
        return torch.cat(seq.prompt_logits)

    def score(self, token_ids, logits_from: int = 0) -> torch.Tensor:
        """fp32 logits [T - logits_from, vocab] of the positions of token_ids from logits_from on (row i predicts
        token logits_from + i + 1), computed through the paged cache (chunked prefill, same KV storage as
        generation; with prefix caching on, positions before logits_from may be cache hits). Raises
        KVConvertError if it cannot run."""
        if isinstance(token_ids, torch.Tensor):
            token_ids = token_ids.reshape(-1).tolist()
        rid = self.add_request(list(token_ids), SamplingParams(max_tokens=0), want_prompt_logits=True,
                               logits_from=logits_from)
        while rid not in self._finished:
            self.step()
        return self.take_scores(rid)

    def _output(self, seq: Sequence) -> Output:
        text = None
        with contextlib.suppress(KVConvertError):  # a folder without a tokenizer: token ids only
            text = None if seq.error else self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
        return Output(
            request_id=seq.seq_id, prompt_token_ids=seq.prompt_token_ids, token_ids=seq.output_token_ids,
            text=text, finish_reason=seq.finish_reason, error=seq.error, num_cached_tokens=seq.num_cached_tokens,
            num_preemptions=seq.num_preemptions,
            time_to_first_token_s=None if seq.first_token_time is None else seq.first_token_time - seq.arrival_time,
            latency_s=None if seq.finish_time is None else seq.finish_time - seq.arrival_time,
        )


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, (str, torch.Tensor)):
        prompts = [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # a single token-id prompt
    return [p.tolist() if isinstance(p, torch.Tensor) else p for p in prompts]
