"""RLHF with several engines in one process: a PPO-style loop with four engines, and DeepSpeed-Chat's
pattern of one engine per model, each with its own config (stage, precision, offload).

Tiny Hugging Face models built from configs: the actor (trained, generates) and the reference are
LlamaForCausalLM; the critic (trained) and the reward model are LlamaForSequenceClassification with
one label. The reference and reward engines are forward only (no optimizer in their configs).
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch

from tests.harness import run_ranks

pytest.importorskip("transformers", reason="transformers is a test dependency (pip install -e '.[test]')")

BF16 = {"bf16": {"enabled": True}}
ADAMW = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
PERSIST_NOTHING = {"stage3_param_persistence_threshold": 0}


def _zero(stage: int, offload: bool = False) -> dict:
    zero = {"stage": stage, **(PERSIST_NOTHING if stage == 3 else {})}
    if offload:
        zero["offload_param"] = {"device": "cpu"}
    return {"zero_optimization": zero}


# (actor, critic, reference, reward): the four-engine loop at stage 3 with the frozen two offloaded to the
# host, and DeepSpeed-Chat's mix (every engine its own stage and precision)
LAYOUTS = {
    "stage3_offloaded": ({**_zero(3), **BF16, **ADAMW}, {**_zero(3), **BF16, **ADAMW},
                         {**_zero(3, offload=True), **BF16}, {**_zero(3, offload=True), **BF16}),
    "deepspeed_chat_mix": ({**_zero(3), **BF16, **ADAMW}, {**_zero(2), **ADAMW},
                           {**_zero(3, offload=True), **BF16}, {**_zero(0)}),
}


def _unsharded(config: dict) -> dict:
    """The same engine at stage 0 without offload: the reference run."""
    return {**config, "zero_optimization": {"stage": 0}}


def _models():
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                         pad_token_id=0, eos_token_id=None, bos_token_id=None, num_labels=1)
    torch.manual_seed(0)
    actor = LlamaForCausalLM(config)
    reference = copy.deepcopy(actor).requires_grad_(False)
    torch.manual_seed(1)
    critic = LlamaForSequenceClassification(config)
    torch.manual_seed(2)
    reward = LlamaForSequenceClassification(config).requires_grad_(False)
    return actor, critic, reference, reward


def _token_logprobs(logits: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, seq[:, 1:, None]).squeeze(-1)


def _tracked_bytes() -> int:
    """Bytes of every tensor storage alive in the process, each storage once (what the engines' ledgers
    must add up to when nothing else is held)."""
    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.layout == torch.strided and obj.device.type != "meta":
            storage = obj.untyped_storage()
            storages[storage.data_ptr() or id(storage)] = storage.nbytes()
    return sum(storages.values())


def _ppo(rank: int, world: int, layout: str, unsharded: bool) -> dict:
    import zerodp

    configs = [{"train_micro_batch_size_per_gpu": 2, **(_unsharded(c) if unsharded else c)} for c in LAYOUTS[layout]]
    engines = [zerodp.initialize(model=m, config=c)[0] for m, c in zip(_models(), configs)]
    actor, critic, reference, reward = engines
    losses = []
    for step in range(2):
        prompts = torch.randint(1, 64, (2, 4), generator=torch.Generator().manual_seed(100 * step + rank))
        with torch.no_grad(), zerodp.zero.GatheredParameters(actor.module.parameters()):  # one gather per unit
            seq = actor.module.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=4,
                                        do_sample=False)
        with torch.no_grad():
            ref_logprobs = _token_logprobs(reference(seq).logits, seq)
            score = reward(seq).logits.float().squeeze(-1)
            old_values = critic(seq).logits.float().squeeze(-1)
        logprobs = _token_logprobs(actor(seq).logits, seq)
        kl = (logprobs - ref_logprobs)[:, 3:].sum(-1)
        advantage = (score - 0.1 * kl.detach() - old_values)
        ratio = torch.exp(logprobs - logprobs.detach())[:, 3:].mean(-1)  # one PPO epoch: the ratio is 1
        actor_loss = -(advantage * ratio).mean()
        actor.backward(actor_loss)
        actor.step()
        value_loss = (critic(seq).logits.float().squeeze(-1) - (score - 0.1 * kl.detach())).pow(2).mean()
        critic.backward(value_loss)
        critic.step()
        losses.append((actor_loss.item(), value_loss.item(), score.tolist()))
    del prompts, seq, ref_logprobs, score, old_values, logprobs, kl, advantage, ratio, actor_loss, value_loss
    gc.collect()
    held = [e.memory_report()["held"] for e in engines]
    ledger_bytes = sum(b for h in held for tiers in h.values() for tier, b in tiers.items() if tier != "nvme")
    return {"losses": losses, "held": held, "ledger_bytes": ledger_bytes, "tracked_bytes": _tracked_bytes(),
            "forward_only": [e.forward_only for e in engines]}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_ppo_loop_with_four_engines_matches_the_unsharded_loop_and_the_ledgers_add_up(layout: str) -> None:
    sharded = run_ranks(_ppo, 2, args=(layout, False))
    unsharded = run_ranks(_ppo, 2, args=(layout, True))
    for rank, (got, want) in enumerate(zip(sharded, unsharded)):
        assert got["forward_only"] == [False, False, True, True]
        # within ulps of the unsharded loop (fp32 stage 2 averages its gradients in another order than stage 0)
        flat = [x for a, v, scores in got["losses"] for x in (a, v, *scores)]
        assert flat == pytest.approx([x for a, v, scores in want["losses"] for x in (a, v, *scores)], rel=1e-5, abs=1e-7)
        actor, critic, reference, reward = got["held"]
        for frozen in (reference, reward):  # forward only: 16-bit (or fp32) weights and buffers, nothing else
            assert set(frozen) <= {"param16", "param32_master", "buffer"} and "grad" not in frozen
        assert reference["param16"] == {"cpu": reference["param16"]["cpu"]}  # offloaded to the host
        assert {"grad", "optim_state"} <= set(actor) and {"grad", "optim_state"} <= set(critic)
        # nothing held that a ledger does not count, and nothing counted twice
        assert got["ledger_bytes"] == got["tracked_bytes"], (rank, got["ledger_bytes"], got["tracked_bytes"], got["held"])
