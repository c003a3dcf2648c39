"""Validation suites: what `kvconvert validate --suite NAME` runs.

SUITE_VERSION names the definition of every suite below together with the sample generators
and scorers. Change it whenever a change would alter any sample or score: reports made with
another version are refused by `kvconvert gate`, and cached results keyed by content hash are
recomputed where prompts changed.

Sizes (SmolLM2-135M, 2 CPU cores): smoke < 1 min (tests), quick minutes per model (the
source's part is measured once for every candidate: kvconvert.eval.validate), standard ~30 min;
full is meant for a GPU. Lengths longer than a model's context are dropped with a note in the report.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvconvert.errors import KVConvertError
from kvconvert.eval.haystack import RULER_TASKS
from kvconvert.eval.metrics import LONGBENCH_TASKS

# 5: the long window is the long NIAH prompt (its K/V shared through the prefix cache); 4: quick's passkey/NIAH at
# 512 and 4096 tokens (long_lengths), KL at 4096 (long_window_len); 3: answer likelihoods, LongBench by its protocol
# (chat template, dataset2maxlen); 2: quick 8 x 2
SUITE_VERSION = 5
SEED = 20240611

# The quick suite's LongBench-mini subset: 2 samples (the fewest that give an interval) of 8 tasks on which
# SmolLM2-135M scored highest in the standard suite's 3 samples per task at 2K (docs/validate-25pct-healed: one
# per category or more, none where the source scored 0 on every sample: such a task cannot show a drop), with
# LongBench's own budgets (dataset2maxlen); summarization (512 new tokens) does not fit its 512-token prompts, so
# qasper (128) stands in for multi_news. The interval of longbench_avg_drop is wide on 8 x 2 (25 points on a
# heavily degraded candidate, docs/BENCHMARKS.md, "The README's main job"): it decides a large drop, not a small
# one; the answer likelihoods of the same samples (answer_nll_increase) are the quick suite's fine measure.
QUICK_LONGBENCH_TASKS = ("samsum", "trec", "lcc", "qasper", "2wikimqa", "multifieldqa_en", "triviaqa", "musique")


@dataclass(frozen=True)
class SuiteSpec:
    """One suite. Lengths are prompt lengths in tokens; depths are fractions of the haystack.

    ppl_windows x ppl_window_len: essay windows for perplexity and KL (0 windows = skip).
    long_window_len: one more window of this many tokens (0 = none), the NIAH prompt of that length (the essays, the
    needle at the first of long_depths), whose last ppl_window_len positions are scored: perplexity and KL where the
    cache already holds the tokens before them (a long NIAH sample of the same length reuses its K/V).
    passkey_*: grid lengths x depths x repeats (different keys). niah_*: grid lengths x depths.
    long_lengths x long_depths: a sparser grid at long context, for passkey and NIAH both (a 4-bit cache's error
    grows with the tokens it holds; a prompt of 4096 tokens costs a CPU about as much as eight of 512).
    ruler_*: tasks x lengths x samples, generation budget capped at ruler_max_new (None = RULER's).
    longbench_*: first `longbench_per_task` rows of each task (None = all), prompts truncated to
    longbench_context tokens (None = the models' context), budget capped at longbench_max_new. A suite that
    runs LongBench needs its data: a missing folder is refused like an empty one, never skipped.
    """

    name: str
    description: str
    ppl_windows: int
    ppl_window_len: int
    long_window_len: int = 0
    passkey_lengths: tuple[int, ...] = ()
    passkey_depths: tuple[float, ...] = ()
    passkey_repeats: int = 1
    niah_lengths: tuple[int, ...] = ()
    niah_depths: tuple[float, ...] = ()
    long_lengths: tuple[int, ...] = ()
    long_depths: tuple[float, ...] = (0.5,)
    ruler_tasks: tuple[str, ...] = ()
    ruler_lengths: tuple[int, ...] = ()
    ruler_samples: int = 0
    ruler_max_new: int | None = None
    longbench: bool = True
    longbench_tasks: tuple[str, ...] | None = None
    longbench_per_task: int | None = None
    longbench_context: int | None = None
    longbench_max_new: int | None = None
    seed: int = SEED

    def __post_init__(self):
        if self.ppl_windows < 0 or (self.ppl_windows and self.ppl_window_len < 16):
            raise KVConvertError(f"suite {self.name}: perplexity windows need >= 16 tokens")
        if self.long_window_len and (not self.ppl_windows or self.long_window_len <= self.ppl_window_len):
            raise KVConvertError(f"suite {self.name}: the long window ({self.long_window_len} tokens) scores its last "
                                 f"ppl_window_len positions: it needs perplexity windows and more tokens than they have")
        for depth in self.passkey_depths + self.niah_depths + self.long_depths:
            if not 0.0 <= depth <= 1.0:
                raise KVConvertError(f"suite {self.name}: depth {depth} outside [0, 1]")
        for length in self.passkey_lengths + self.niah_lengths + self.ruler_lengths + self.long_lengths:
            if length < 64:
                raise KVConvertError(f"suite {self.name}: length {length} is too short (>= 64 tokens)")
        unknown = [t for t in self.ruler_tasks if t not in RULER_TASKS]
        unknown += [t for t in self.longbench_tasks or () if t not in LONGBENCH_TASKS]
        if unknown:
            raise KVConvertError(f"suite {self.name}: unknown task(s) {', '.join(unknown)}")

    def as_dict(self) -> dict:
        return {**asdict(self), "version": SUITE_VERSION}


DEPTHS_5 = (0.0, 0.25, 0.5, 0.75, 1.0)
DEPTHS_11 = tuple(i / 10 for i in range(11))

SUITES: dict[str, SuiteSpec] = {
    "smoke": SuiteSpec(
        name="smoke", description="every task once, tiny (tests; < 1 min on 2 cores)",
        ppl_windows=2, ppl_window_len=128,
        passkey_lengths=(256,), passkey_depths=(0.0, 1.0),
        niah_lengths=(256,), niah_depths=(0.0, 1.0),
        ruler_tasks=("niah_single_2", "vt"), ruler_lengths=(256,), ruler_samples=1, ruler_max_new=12,
        longbench_tasks=("2wikimqa", "lcc"), longbench_per_task=1,
        longbench_context=256, longbench_max_new=8,
    ),
    "quick": SuiteSpec(
        name="quick", description="pre-merge check (SmolLM2-135M: minutes per model on 2 CPU cores); KL on 4 x 512 "
                                  "essay tokens and on the last 512 of the 4096-token NIAH prompt; passkey and "
                                  "NIAH at 512 tokens x 3 depths and at 4096 tokens (half depth); no RULER; "
                                  "LongBench-mini: 8 tasks x 2 samples at 512 tokens, LongBench's budgets",
        ppl_windows=4, ppl_window_len=512, long_window_len=4096,
        passkey_lengths=(512,), passkey_depths=(0.0, 0.5, 1.0),
        niah_lengths=(512,), niah_depths=(0.0, 0.5, 1.0), long_lengths=(4096,), long_depths=(0.5,),
        longbench_tasks=QUICK_LONGBENCH_TASKS, longbench_per_task=2, longbench_context=512, longbench_max_new=None,
    ),
    "standard": SuiteSpec(
        name="standard", description="the project's protocol: 32 x 1024 essay tokens, retrieval to 4K, "
                                     "RULER, 3 LongBench samples per task at 2K (~30 min on 2 CPU cores)",
        ppl_windows=32, ppl_window_len=1024,
        passkey_lengths=(1024, 2048, 4096), passkey_depths=DEPTHS_5,
        niah_lengths=(1024, 2048, 4096), niah_depths=DEPTHS_5,
        ruler_tasks=("niah_single_2", "niah_multikey_1", "niah_multivalue", "vt"), ruler_lengths=(1024, 2048),
        ruler_samples=3, ruler_max_new=48,
        longbench_per_task=3, longbench_context=2048, longbench_max_new=None,
    ),
    "full": SuiteSpec(
        name="full", description="for GPUs: retrieval grids to the model's context, all RULER tasks, "
                                 "all LongBench-mini samples at full budgets",
        ppl_windows=32, ppl_window_len=1024,
        passkey_lengths=(1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072), passkey_depths=DEPTHS_11,
        passkey_repeats=2,
        niah_lengths=(1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072), niah_depths=DEPTHS_11,
        ruler_tasks=RULER_TASKS, ruler_lengths=(4096, 8192, 16384, 32768, 65536, 131072), ruler_samples=10,
        longbench_per_task=None, longbench_context=None, longbench_max_new=None,
    ),
}


def get_suite(name: str) -> SuiteSpec:
    if name not in SUITES:
        raise KVConvertError(f"unknown suite {name!r}; choose one of {', '.join(SUITES)}")
    return SUITES[name]
