"""`zerodp compare`: one model trained by torch DDP, FSDP2, DeepSpeed and zerodp's strategies, side by side.

The explain layer's side-by-side runs: it may import plan/ and the runtime; nothing below imports it.

    zerodp compare --out compare-demo                     # the demo's GPT, 2 ranks, every framework
    zerodp compare gpt:d_model=256,n_layer=6 --frameworks ddp,zerodp1,zerodp3 --rounds 3 --out cmp

Writes DIR/report.md (the tables and a verdict), DIR/results.json (every measurement), each
launch's output under DIR/logs/ and, with matplotlib installed, DIR/memory.png, DIR/step_time.png,
DIR/communication.png and DIR/loss.png.

    frameworks.py   what can be compared (FRAMEWORKS), the shared AdamW, --frameworks' parse
    rounds.py       compare(): the launches interleaved over rounds, then the report
    launch.py       one launch: N spawned ranks, the first failure or timeout stops them all
    worker.py       one rank of a launch: build, warm up, time the steps, measure memory and bytes sent
    runners.py      forward / backward / step around DDP, FSDP2, a DeepSpeed or a zerodp engine
    attribution.py  who holds the bytes live after the warm-up (parameters, gradients, masters, state)
    summary.py      a framework's launches as one row, beside the paper's volume and zerodp's estimate
    markdown.py     report.md (the verdict and the tables) and results.json
    plots.py        the PNGs (matplotlib, imported only to draw)

[Note: what compare measures]
Every framework trains in fresh processes (spawned; gloo on the CPU), one framework at a time, and
the frameworks are interleaved over rounds, so a slow spell of the machine falls on all of them
alike. Each launch builds the model from the same seed and trains `warmup` + `steps` optimizer steps
with the same AdamW, clipping at 1.0, on the same data (rank r's micro-batch of step i is drawn from
a generator seeded by i and r), one micro-batch per step.
- Step time: each timed step starts after a barrier; forward, backward and the optimizer step are
  timed on rank 0 by the host clock (on CUDA after a synchronize). The figure is the median over the
  timed steps of every round; tokens/s = micro-batch x sequence length x ranks / step time.
- Memory (the first round's launch only, so the profiler's cost never reaches a timed step): the
  CPU allocator's own accounting (zerodp/plan/measure.py's AllocatorTrace) from before the model is
  built through the warm-up steps gives the peak of live bytes on rank 0. After the last warm-up step
  the bytes then live are split by what holds them: zerodp's ledger for zerodp; for the others the
  storages of the parameters (FSDP2's local shards, DeepSpeed's partitions), of their `.grad`, and of
  the innermost torch optimizer's parameters that are not the model's (fp32 masters) and its state.
  "Other held" is the rest of what is live then (DDP's gradient buckets, module buffers, the batch);
  "transient" is peak minus held: activations saved for backward, gathered stage-3 parameters,
  communication buffers, temporaries. On CUDA, `torch.cuda.max_memory_allocated` gives the peak.
- Communication: the bytes rank 0 wrote to its sockets per timed step (/proc/self/io's wchar; gloo
  sends over TCP through write calls, so this is the traffic on the wire, whatever the framework),
  beside the ZeRO paper's volume per rank: 2 Psi per step for DDP and stages 0-2 (a reduce-scatter
  and an all-gather of Psi bytes, Psi = parameters x the communicated dtype's bytes), 3 Psi for
  stage 3 and resharding FSDP (one more all-gather, for backward). A ring collective over N ranks
  sends (N - 1) / N of that per rank, so the wire figure is compared with the paper's x (N - 1) / N.
  NCCL's traffic does not pass through the process's write calls: on CUDA the column stays empty.
- Loss: rank 0's loss at every step; at fp32 zerodp's stages match DDP's bitwise (tests/test_parity.py).
A framework that fails (not installed, an error, a rank that dies, a launch past --timeout) is
reported in the table with its reason; the rest of the report is still written.
"""

from __future__ import annotations

from zerodp.report.frameworks import FRAMEWORKS, CompareError, Framework, parse_frameworks
from zerodp.report.rounds import compare

__all__ = ["FRAMEWORKS", "CompareError", "Framework", "compare", "parse_frameworks"]
