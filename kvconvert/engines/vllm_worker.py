"""Serve requests on one model with stock vLLM. Runs INSIDE vLLM's own venv.

    .venv-vllm/bin/python kvconvert/engines/vllm_worker.py CONFIG.json  < requests  > answers

Imports only vLLM, torch, safetensors (a vLLM dependency) and the standard library: vLLM pins
its own transformers, so this file must not import kvconvert. kvconvert.engines.vllm starts it by
path in a subprocess, writes one JSON request per line on its stdin and reads one JSON answer per
line from its stdout. Everything else this process prints (vLLM's logs, C++ warnings) goes to
stderr: file descriptor 1 is moved to stderr before vLLM is imported, answers use a saved copy.

CONFIG (JSON object, the engine's settings):
    model           checkpoint folder (config.json + safetensors)
    dtype           "float32" | "bfloat16" | "float16" (default float32)
    kv_cache_dtype  vLLM's kv_cache_dtype: "auto" | "bfloat16" | "fp8" | ... (default auto)
    max_model_len   context length (default 2048)
    compile         false (default): eager; true: vLLM's default torch.compile mode

Requests (one JSON object per line; the answer echoes "op"):
    {"op": "info"} -> vllm_version, torch_version, platform (vLLM's device type: "cpu", "cuda", ...),
        attention ({layer class: backend}), kv_scales
        ({layer: {k_scale, v_scale, class, kv_cache_dtype}}: per-tensor scales as the attention
        layers hold them after loading; a layer vLLM loaded none for keeps its default 1.0)
    {"op": "score", "prompt_ids": [int], "logits_file": path?} -> prompt_logprobs ([T-1] floats:
        log p(ids[t+1] | ids[:t+1])); with logits_file, also writes there (safetensors, "logits"
        [T-1, vocab] fp32) the rows vLLM's own logits processor produced for the prompt
    {"op": "generate", "prompt_ids": [int], "max_tokens": int, "stop_ids": [int]?} -> tokens
        (greedy; without stop_ids the continuation ignores EOS and runs max_tokens steps)
A refused request answers {"op": ..., "error": "..."}; an error raised inside vLLM answers the same
with "fatal": true and ends the process; a bad CONFIG ends it with exit 2.

Settings that make stock vLLM 0.32's CPU build compute the right numbers:
- VLLM_ENABLE_V1_MULTIPROCESSING=0 keeps the engine in this process, so `llm.apply_model` reaches
  the real model (forward hook on the logits processor, reading k_scale / v_scale).
- custom_ops ["-rotary_embedding"]: vLLM's CPU rotary kernel mis-rotates the 3-D [tokens, heads,
  dim] tensors DeepSeek attention passes (seen: ppl 376 instead of 19); the native PyTorch rotary
  path is exact, in eager mode and in compile mode alike. Eager is the default here: compiling
  costs about 2 minutes per start on 2 cores and gives the same numbers within fp32 rounding.
- no prefix caching and no chunked prefill: each prompt runs as one prefill, so the logits of a
  scored prompt come out of the logits processor as one [T-1, vocab] block.
- an MLA model in float32 on the CPU runs on the CPU_MLA backend: on a host with AMX tiles vLLM
  picks AMX_MLA by itself, which takes only 16-bit weights and refuses to load an fp32 model
  ("expect weight to be bfloat16, float16, int8, fp8_e4m3 or uint8", seen on a Sapphire Rapids
  class Xeon). CPU_MLA is vLLM's reference MLA path on every x86 host; 16-bit dtypes and GPU
  builds keep vLLM's own choice.
"""

from __future__ import annotations

import json
import os
import sys
import time

# Run by path, Python puts this folder first on sys.path, where kvconvert/engines/vllm.py would
# shadow the real vllm package: drop it (the caller also passes -P, which skips it).
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's default takes a share of RAM
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


class BadRequest(ValueError):
    """A request this worker refuses before vLLM sees it (the engine stays usable)."""


def fail(message: str) -> None:
    """A configuration error the caller shows as it is (exit 2, message on stderr)."""
    print(f"vllm_worker: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def check_config(config: dict) -> None:
    if not os.path.isfile(os.path.join(str(config.get("model", "")), "config.json")):
        fail(f"model folder {config.get('model')!r} has no config.json")
    unknown = set(config) - {"model", "dtype", "kv_cache_dtype", "max_model_len", "compile"}
    if unknown:
        fail(f"unknown config keys {sorted(unknown)}")


def make_llm(config: dict):
    from vllm import LLM

    max_len = int(config.get("max_model_len") or 2048)
    backend = {"attention_backend": "CPU_MLA"} if needs_cpu_mla(config) else {}
    return LLM(
        model=config["model"],
        tokenizer=config["model"],
        dtype=config.get("dtype", "float32"),
        kv_cache_dtype=config.get("kv_cache_dtype", "auto"),
        max_model_len=max_len,
        max_num_batched_tokens=max_len,  # a whole prompt fits one step: no chunking
        max_num_seqs=1,
        enable_prefix_caching=False,
        enable_chunked_prefill=False,
        trust_remote_code=False,
        seed=0,
        enforce_eager=not config.get("compile", False),
        compilation_config={"custom_ops": ["-rotary_embedding"]},
        **backend,
    )


def needs_cpu_mla(config: dict) -> bool:
    """True for an MLA checkpoint served in float32 by vLLM's CPU platform (see the module docstring)."""
    from vllm.platforms import current_platform

    with open(os.path.join(config["model"], "config.json"), encoding="utf-8") as f:
        is_mla = json.load(f).get("kv_lora_rank") is not None
    return is_mla and current_platform.is_cpu() and config.get("dtype", "float32") in ("float32", "float")


# --------------------------------------------------------------------------- requests

def info(llm, _request: dict | None = None) -> dict:
    import torch
    import vllm
    from vllm.platforms import current_platform

    def read(model):
        backends, scales = {}, {}
        for name, module in model.named_modules():
            backend = getattr(module, "attn_backend", None)
            if backend is not None and hasattr(backend, "get_name"):
                backends[type(module).__name__] = backend.get_name()
            if hasattr(module, "_k_scale_float"):
                scales[name] = {"k_scale": float(module._k_scale_float), "v_scale": float(module._v_scale_float),
                                "class": type(module).__name__,
                                "kv_cache_dtype": str(getattr(module, "kv_cache_dtype", "?"))}
        return backends, scales

    ((backends, scales),) = llm.apply_model(read)
    return {"vllm_version": vllm.__version__, "torch_version": torch.__version__,
            "platform": str(current_platform.device_type), "attention": backends, "kv_scales": scales}


def capture_prompt_logits(llm, prompt_rows: int):
    """Forward hook on the model's logits processor; returns (captured list, remove()).

    One unchunked prefill calls the logits processor once for the sampled position ([1, vocab])
    and once for the prompt-logprob positions ([T-1, vocab]); the hook keeps the latter."""
    captured: list = []

    def hook(_module, _inputs, output):
        if output is not None and output.dim() == 2 and output.shape[0] == prompt_rows:
            captured.append(output.detach().float().cpu().clone())

    handles = llm.apply_model(lambda model: model.logits_processor.register_forward_hook(hook))
    return captured, lambda: [h.remove() for h in handles]


def run_prompt(llm, ids: list[int], **sampling):
    """vLLM's RequestOutput for one prompt of token ids, greedy (temperature 0)."""
    from vllm import SamplingParams, TokensPrompt

    (out,) = llm.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(temperature=0.0, **sampling),
                          use_tqdm=False)
    return out


def score(llm, request: dict) -> dict:
    ids = [int(t) for t in request["prompt_ids"]]
    if len(ids) < 2:
        raise BadRequest("score needs at least 2 prompt tokens")
    logits_file = request.get("logits_file")
    captured, remove = capture_prompt_logits(llm, len(ids) - 1) if logits_file else (None, None)
    try:
        out = run_prompt(llm, ids, max_tokens=1, prompt_logprobs=0, ignore_eos=True)
    finally:
        if remove is not None:
            remove()
    # out.prompt_logprobs[0] is None (nothing predicts the first token); entry t maps token ids
    # to Logprob objects and always contains the prompt's own token ids[t].
    answer = {"prompt_logprobs": [entry[tok].logprob for tok, entry in zip(ids[1:], out.prompt_logprobs[1:])]}
    if logits_file:
        if len(captured) != 1:
            raise RuntimeError(f"expected one [{len(ids) - 1}, vocab] block from vLLM's logits processor, "
                               f"captured {len(captured)}")
        save_logits(captured[0], logits_file)
        answer["logits_file"] = logits_file
    return answer


def save_logits(logits, path: str) -> None:
    from safetensors.torch import save_file

    tmp = f"{path}.tmp-{os.getpid()}"
    save_file({"logits": logits.contiguous()}, tmp)
    os.replace(tmp, path)


def generate(llm, request: dict) -> dict:
    stop_ids = [int(t) for t in request.get("stop_ids") or []]
    out = run_prompt(llm, [int(t) for t in request["prompt_ids"]], max_tokens=int(request["max_tokens"]),
                     ignore_eos=not stop_ids, stop_token_ids=stop_ids or None)
    tokens = list(out.outputs[0].token_ids)
    while tokens and tokens[-1] in stop_ids:  # vLLM returns the stop token itself
        tokens.pop()
    return {"tokens": tokens}


OPS = {"info": info, "score": score, "generate": generate}


def serve(llm, answers) -> None:
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        op = request.get("op")
        started = time.time()
        fatal = False
        try:
            if op not in OPS:
                raise BadRequest(f"unknown op {op!r}; choose from {sorted(OPS)}")
            answer = OPS[op](llm, request)
        except BadRequest as exc:
            answer = {"error": str(exc)}
        except Exception as exc:
            # An error inside vLLM leaves its in-process engine with the failed request still
            # scheduled (a later request then never finishes): answer, then end the process.
            answer, fatal = {"error": f"{type(exc).__name__}: {exc}", "fatal": True}, True
        answer.update(op=op, seconds=round(time.time() - started, 2))
        answers.write(json.dumps(answer) + "\n")
        answers.flush()
        if fatal:
            return


def main(argv: list[str]) -> None:
    if len(argv) != 2:
        fail("usage: vllm_worker.py CONFIG.json  (requests on stdin, answers on stdout)")
    # Answers go to a private copy of stdout; fd 1 then points at stderr, so nothing vLLM or its
    # C++ extensions print can corrupt the answer stream.
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    with open(argv[1]) as f:
        config = json.load(f)
    check_config(config)
    started = time.time()
    try:
        llm = make_llm(config)
    except ImportError as exc:
        fail(f"vllm does not import in {sys.executable}: {exc}")
    except Exception as exc:  # vLLM refuses the model or its settings: say so in one line
        fail(f"vLLM could not load {config['model']}: {type(exc).__name__}: {str(exc).strip().splitlines()[-1][:500]}")
    answers.write(json.dumps({"op": "ready", "seconds": round(time.time() - started, 1)}) + "\n")
    answers.flush()
    serve(llm, answers)


if __name__ == "__main__":
    main(sys.argv)
