"""Online adaptation of draft heads (heads.online) on tiny random Llama targets (CPU, seconds).

A head that starts random learns the target's continuations on a repetitive stream (and a
frozen copy does not); with updates every step the output stays exactly the target's
(greedy identity with HF, chi-square when sampling); a forced NaN / explosion / non-finite
step is rolled back to the last good weights; the buffer stays within its capacity; the
adapted head saves in the trained-head format and loads back; the same drafter object keeps
its weights across generate calls.
"""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("scipy.stats")
pytest.importorskip("safetensors")

import specdec_kernels as sk  # noqa: E402
from specdec_kernels.heads import EagleDrafter, HeadNgramDrafter, MedusaDrafter, default_drafter  # noqa: E402
from specdec_kernels.heads.common import read_head, target_identity  # noqa: E402
from specdec_kernels.heads.modules import EagleHead, MedusaHeads  # noqa: E402
from specdec_kernels.heads.online import OnlineOptions  # noqa: E402
from specdec_kernels.heads.train import head_config  # noqa: E402
from test_generate import (  # noqa: E402
    SAMPLE_PROMPT, SAMPLE_ROWS, VOCAB, chi_square_pvalue, exact_pair_distribution, hf_greedy, left_pad,
    repetitive_prompts, tiny_model,
)
from test_generate import free_planner, one_thread, target  # noqa: E402,F401  (fixtures)
from test_heads import small_target_heads, train  # noqa: E402,F401  (small_target_heads: a fixture)


def random_head(target, kind: str, vocab: int = VOCAB, seed: int = 0):
    """An untrained head module for `target` (EAGLE: small random init; Medusa: zero init,
    i.e. every head starts as the target's own next-token head)."""
    module = (EagleHead if kind == "eagle" else MedusaHeads)(head_config(target, kind, vocab))
    module.reset_parameters(torch.Generator().manual_seed(seed))
    module.draft_vocab.copy_(torch.arange(vocab))
    return module


def eagle(target, online, head=None, **kw):
    args = dict(max_nodes=4, depth=4, top_k=1, min_score=0.0, dtype=torch.float32)
    args.update(kw)
    return EagleDrafter(target, head if head is not None else random_head(target, "eagle"), online=online, **args)


def weights(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


# ----------------------------------------------------------------------------- learning


def stream(drafter, target, prompts, new_tokens=32):
    """Tokens per step of each prompt of the stream, served one after another by `drafter`."""
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        result = sk.generate(target, ids, drafter=drafter, max_new_tokens=new_tokens, adaptive=False)
        assert torch.equal(result.sequences, hf_greedy(target, ids, torch.ones_like(ids), new_tokens))
        out.append(result.stats.tokens_per_step)
    return out


@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "bf16"])
def test_random_head_learns_a_repetitive_stream(mixed):
    """A random EAGLE head (a chain of 4, every node verified) serving a repetitive stream
    (three prompts, three times): online, its tokens per step in the last round clearly beat
    its first round and the same head frozen (which stays near 1), with fp32 updates and with
    bf16 ones (bf16 label logits too). With a learning rate too small to teach anything (1e-6)
    both assertions fail: online equals frozen then."""
    target = tiny_model(3, logit_scale=6.0)  # peaked distributions: something to learn
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(1, VOCAB, (12,), generator=g).tolist() for _ in range(3)] * 3
    settings = dict(interval=1, lr=3e-3, batch=64, window=32, min_positions=8, prompt_weight=1.0, mixed_precision=mixed)
    learner = eagle(target, settings)
    assert learner.online.w_label_low.dtype == (torch.bfloat16 if mixed else torch.float32)
    online = stream(learner, target, prompts)
    frozen = stream(eagle(target, False), target, prompts)
    first, last, last_frozen = sum(online[:3]) / 3, sum(online[-3:]) / 3, sum(frozen[-3:]) / 3
    assert last > 1.5 * last_frozen, (online, frozen)
    assert last > first + 0.5, online


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_backoff_spaces_out_updates_that_do_not_pay(kind):
    """`backoff`: a random head serving a repetitive stream with a learning rate that teaches
    it (3e-3) measures a clear gain over its starting weights and keeps updating every step;
    the same stream with a learning rate too small to teach anything (1e-7) measures no gain
    and backs off to backoff x interval, taking far fewer updates. With backoff=1 the
    interval never moves and no gain is measured."""
    target = tiny_model(3, logit_scale=6.0)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(1, VOCAB, (12,), generator=g).tolist() for _ in range(3)] * 2
    base = dict(interval=1, batch=64, window=32, min_positions=8, prompt_weight=1.0, mixed_precision=False)

    def drafter(settings):
        if kind == "eagle":
            return eagle(target, settings)
        return MedusaDrafter(target, random_head(target, "medusa"), max_nodes=4, top_k=1, dtype=torch.float32,
                             online=settings)

    learning = drafter(dict(base, lr=3e-3, backoff=8))
    stream(learning, target, prompts)
    learned = learning.online.stats
    assert learned.gain > 0.1 and learned.interval == 1 and learned.updates > 0.4 * learned.steps, learned
    idle = drafter(dict(base, lr=1e-7, backoff=8))
    stream(idle, target, prompts)
    stats = idle.online.stats
    assert abs(stats.gain) < 0.02 and stats.interval == 8, stats
    assert stats.updates < 0.3 * stats.steps and stats.updates < learned.updates / 2, (stats, learned)
    fixed = drafter(dict(base, lr=1e-7, backoff=1))
    stream(fixed, target, prompts)
    stats = fixed.online.stats
    assert fixed.online.initial is None and stats.interval == 1 and stats.gain != stats.gain, stats  # nan


def test_prompt_steps_learn_from_the_prompt():
    """`prompt_steps`: optimiser steps on each call's prompt positions before its first
    draft, and only there. A random EAGLE head reads prompt A followed by the target's own
    greedy continuation C of A (as a prompt, nothing trained on generated positions: the
    regular updates never run); asked afterwards to continue A, it drafts C far better than
    the same head without prompt steps (which stays near 1 token per step)."""
    target = tiny_model(3, logit_scale=6.0)
    g = torch.Generator().manual_seed(5)
    a = torch.randint(1, VOCAB, (1, 12), generator=g)
    continued = sk.generate(target, a, max_new_tokens=24).sequences  # A + C
    results = {}
    for steps in (0, 40):
        settings = dict(interval=10**6, prompt_steps=steps, prompt_lr=3e-3, batch=64, window=32, min_positions=8)
        learner = eagle(target, settings)
        sk.generate(target, continued, drafter=learner, max_new_tokens=4, adaptive=False)
        assert learner.online.stats.updates == steps  # the prompt steps alone
        live = learner.online
        out = sk.generate(target, a, drafter=learner, max_new_tokens=24, adaptive=False)
        assert torch.equal(out.sequences, continued)
        results[steps] = out.stats.tokens_per_step
        assert live.stats.updates == 2 * steps
    assert results[40] > 1.5 * results[0], results


def test_prompt_steps_draw_only_prompt_positions(target, heads):
    """The batches of the prompt steps come from prompt positions only: weight 1 there, 0 on
    generated positions (sample j predicts the target's distribution at j + 1)."""
    drafter = EagleDrafter(target, heads["eagle"], max_nodes=4, top_k=1, depth=4, min_score=0.0,
                           online=dict(interval=10**6, prompt_steps=1, min_positions=2, batch=8, window=4))
    learner = drafter.online
    seen = {}
    original = learner._step

    def spy(sources=None):
        if sources is not None:
            seen["weights"] = [s.weights.clone() for s in sources]
            seen["lengths"] = learner._lengths.clone()
        return original(sources)

    learner._step = spy
    ids, mask = left_pad(repetitive_prompts(2, seed=3))
    sk.generate(target, ids, attention_mask=mask, drafter=drafter, max_new_tokens=6,
                adaptive=free_planner(target, drafter))  # drafting (and so learning) whatever it costs here
    lengths = mask.sum(1)
    assert len(seen["weights"]) == 2
    for weights, length in zip(seen["weights"], lengths.tolist()):
        j = torch.arange(weights.numel())
        assert torch.equal(weights, (j < length - 2).float())


# ----------------------------------------------------------------------------- exactness


def online_drafters(target, heads):
    """Head drafters whose head takes an optimiser step before every propose."""
    every_step = dict(interval=1, min_positions=4, batch=32, window=8, lr=1e-2)
    return {
        "eagle_tree_unrolled": EagleDrafter(target, heads["eagle"], max_nodes=8, top_k=3, depth=3, min_score=0.0,
                                            online=dict(every_step, unroll=2)),
        "medusa_tree": MedusaDrafter(target, heads["medusa"], max_nodes=8, top_k=3, online=every_step),
        "eagle+ngram_jsd": HeadNgramDrafter(EagleDrafter(target, heads["eagle"], max_nodes=6, top_k=2, depth=3, min_score=0.0,
                                                         online=dict(every_step, loss="jsd")),
                                            sk.NgramDrafter(num_tokens=3)),
        "eagle_reverse_kl_prompt_steps": EagleDrafter(target, heads["eagle"], max_nodes=4, top_k=1, depth=4, min_score=0.0,
                                                      online=dict(every_step, loss="reverse_kl", refresh_cache=True,
                                                                  prompt_steps=2, prompt_lr=3e-2)),
        "eagle3_tree_unrolled": EagleDrafter(target, heads["eagle3"], max_nodes=8, top_k=3, depth=3, min_score=0.0,
                                             online=dict(every_step, unroll=1)),
    }


@pytest.fixture(scope="module")
def heads(target, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("online_heads")
    return {"eagle": train(target, tmp, "eagle", VOCAB), "medusa": train(target, tmp, "medusa", VOCAB),
            "eagle3": train(target, tmp, "eagle", VOCAB, name="eagle3", feature_layers=[0, 1])}


def learner_of(drafter):
    return drafter.online


def test_greedy_identity_with_updates_every_step(target, heads):
    """Batch 1 and 4 (left padding, rows stopping at an eos at different steps): the
    output equals HF greedy while the head changes every step."""
    for name, drafter in online_drafters(target, heads).items():
        for batch, eos in ((1, None), (4, None), (4, "early")):
            ids, mask = left_pad(repetitive_prompts(batch, seed=11))
            eos_id = None
            if eos:
                plain = sk.generate(target, ids, attention_mask=mask, max_new_tokens=20).sequences
                eos_id = int(plain[1, ids.shape[1] + 4])
            expected = hf_greedy(target, ids, mask, 20, eos_token_id=eos_id)
            before = learner_of(drafter).stats.updates
            out = sk.generate(target, ids, attention_mask=mask, drafter=drafter, max_new_tokens=20, eos_token_id=eos_id,
                              adaptive=free_planner(target, drafter))  # drafting (and so learning) whatever it costs here
            assert torch.equal(out.sequences, expected), (name, batch, eos)
        stats = learner_of(drafter).stats
        assert stats.updates > before and stats.rollbacks == 0, (name, stats)


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "medusa"])
def test_sampling_exact_with_updates_between_steps(small_target_heads, kind):
    """Chi-square against the exact distribution of the first two tokens while the head is
    updated before each of the call's steps (its buffer holds an earlier call's rows)."""
    target, heads = small_target_heads
    settings = dict(interval=1, min_positions=4, batch=64, window=8, lr=1e-2)
    if kind.startswith("eagle"):
        drafter = EagleDrafter(target, heads[kind], max_nodes=6, top_k=2, depth=3, online=settings)
    else:
        drafter = MedusaDrafter(target, heads["medusa"], max_nodes=6, top_k=2, online=settings)
    warm = torch.tensor(SAMPLE_PROMPT).expand(16, -1)
    sk.generate(target, warm, drafter=drafter, max_new_tokens=6, temperature=1.0, seed=5, adaptive=False)
    updates = drafter.online.stats.updates
    ids = torch.tensor(SAMPLE_PROMPT).expand(SAMPLE_ROWS, -1)
    out = sk.generate(target, ids, drafter=drafter, max_new_tokens=2, temperature=1.0, seed=1234, adaptive=False)
    assert drafter.online.stats.updates >= updates + 1  # the head changed during this call
    pvalue = chi_square_pvalue(out.sequences[:, -2:], exact_pair_distribution(target, SAMPLE_PROMPT))
    assert pvalue > 1e-3, f"{kind}: chi-square p = {pvalue}"
    assert out.stats.acceptance_per_depth[0] > 0.05  # drafts exercised


def test_eagle3_learner_trains_on_fused_inputs_and_lm_head_labels(target, heads):
    """An EAGLE-3 head's online buffer holds its fused input features and, as labels, the
    target's LM head inputs (not the fused features): what offline training uses."""
    drafter = EagleDrafter(target, heads["eagle3"], dtype=torch.float32, online=dict(interval=10**6))
    ids = torch.tensor([repetitive_prompts(1, seed=3)[0].tolist()])
    out = sk.generate(target, ids, drafter=drafter, max_new_tokens=12, adaptive=False)
    segment = drafter.online.segments[-1]  # the finished row
    m = segment.size
    with torch.no_grad():
        states = target(out.sequences[:, :m], output_hidden_states=True).hidden_states
        fused = drafter.head.input_features(torch.stack([states[0], states[1]], dim=2))[0]
    torch.testing.assert_close(segment.labels, states[2][0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(segment.feats, fused, rtol=1e-4, atol=1e-4)
    assert torch.equal(segment.next_tokens, out.sequences[0, 1 : m + 1])


# ----------------------------------------------------------------------------- safety


def warmed(target, **settings):
    """An online EAGLE drafter (updates only when asked) after one call filled its buffer."""
    drafter = eagle(target, dict(dict(interval=10**6, min_positions=4, batch=32, window=8), **settings))
    ids, mask = left_pad(repetitive_prompts(2))
    sk.generate(target, ids, attention_mask=mask, drafter=drafter, max_new_tokens=16, adaptive=False)
    for _ in range(4):  # a running average of the loss and a few steps
        drafter.online.update()
    return drafter


def assert_restored(drafter, good):
    learner = drafter.online
    for (name, p), g in zip(learner.master.named_parameters(), good):
        assert torch.equal(p.detach(), g), name
    for (name, p), (_, q) in zip(drafter.head.named_parameters(), learner.master.named_parameters()):
        assert torch.equal(p, q.detach().to(p.dtype)), name  # the serving head too


def test_unrolled_update_loss_adds_the_deeper_depths(target, heads):
    """With unroll=D the online loss is the depth-1 loss plus one term per unrolled depth (the
    training passes of `train_draft_head`, positions i >= d): on one batch it equals the
    depth-1 loss plus the unrolled passes' own losses computed separately (fp32 updates, as
    the separate computation: on a CPU with bf16 units the default would run the head and the
    label logits in bf16, and the comparison would measure rounding, not the decomposition)."""
    from specdec_kernels.heads.train import eagle_passes

    drafter = EagleDrafter(target, heads["eagle"], online=dict(min_positions=4, batch=32, window=8, unroll=2, noise=0.0,
                                                               mixed_precision=False))
    sk.generate(target, repetitive_prompts(1, seed=3)[0][None], drafter=drafter, max_new_tokens=12)
    learner = drafter.online
    batch = learner._batch()
    assert batch is not None
    with torch.no_grad():
        full = learner._loss(batch)
        learner.unroll = 0
        first = learner._loss(batch)
        learner.unroll = 2
        emb = drafter.embed(batch["tok"]).float()
        outs = eagle_passes(learner.master, batch["inp"], emb, batch["pos"], 2)
        logp = torch.log_softmax(batch["tgt"] @ learner.w_label.T, -1)
        w = batch["w"]
        deeper = 0.0
        for d in (1, 2):
            g = outs[d].float()
            per = learner._divergence(g @ learner.w_label.T, logp)
            per = per + learner.options.reg_weight * torch.nn.functional.smooth_l1_loss(g, batch["tgt"], reduction="none").mean(-1)
            deeper = deeper + (per * (torch.arange(g.shape[1]) >= d) * w).sum() / w.sum()
    assert float(deeper) > 0
    torch.testing.assert_close(full, first + deeper, rtol=1e-4, atol=1e-5)


def test_forced_nan_rolls_back(target):
    drafter = warmed(target)
    learner = drafter.online
    assert learner.stats.updates == 4 and learner.stats.rollbacks == 0
    # The last good point: the weights (and AdamW state) the last update's loss was checked
    # on, before its step (the step's result is only judged by the next update's loss).
    good = [g.clone() for g in learner.good]
    state = [t.clone() for t in learner.good_state]
    with torch.no_grad():
        learner.master.fc.weight[0, 0] = float("nan")  # as if the last step had diverged
    assert learner.update() is False
    assert learner.stats.rollbacks == 1
    assert_restored(drafter, good)
    for a, b in zip(learner._state_tensors(), state):
        assert torch.equal(a, b)  # the optimiser state came back too
    assert learner.update() and torch.isfinite(torch.tensor(learner.stats.last_loss))  # and learning goes on
    assert learner.stats.rollbacks == 1


def test_exploding_loss_rolls_back_and_a_hard_batch_does_not(target):
    drafter = warmed(target)
    learner = drafter.online
    good = [g.clone() for g in learner.good]
    with torch.no_grad():
        learner.master.norm.weight.mul_(100.0)  # finite, but the loss explodes
    assert learner.update() is False and learner.stats.rollbacks == 1
    assert_restored(drafter, good)
    # A loss far above the average that the good weights share (hard data, not divergence)
    # is trained on, not rolled back.
    learner.stats.loss_avg = learner.stats.loss_avg / 100.0
    assert learner.update() is True and learner.stats.rollbacks == 1


def test_non_finite_step_is_undone(target):
    drafter = warmed(target, lr=1e39)  # AdamW moves every weight by ~lr: inf
    learner = drafter.online  # (the four warm-up steps above already rolled back)
    assert learner.stats.rollbacks >= 1
    assert all(torch.isfinite(p).all() for p in learner.master.parameters())
    assert all(torch.isfinite(p).all() for p in drafter.head.parameters())


def test_buffer_stays_within_capacity(target):
    drafter = eagle(target, dict(interval=2, capacity=40, min_positions=4, batch=16, window=8))
    for seed in range(4):
        ids, mask = left_pad(repetitive_prompts(3, seed=seed))
        sk.generate(target, ids, attention_mask=mask, drafter=drafter, max_new_tokens=12, adaptive=False)
        sizes = sum(s.size for s in drafter.online.segments)
        assert sizes == drafter.online.stats.buffered <= 40
    assert drafter.online.stats.buffered >= 30  # filled (then bounded)
    assert drafter.online.stats.updates > 0


# ----------------------------------------------------------------------------- state


def test_save_and_load_round_trip(target, heads, tmp_path):
    drafter = EagleDrafter(target, heads["eagle"], dtype=torch.float32, online=dict(interval=1, min_positions=4, lr=1e-2))
    ids, mask = left_pad(repetitive_prompts(2))
    sk.generate(target, ids, attention_mask=mask, drafter=drafter, max_new_tokens=12, adaptive=False)
    assert drafter.online.stats.updates > 0
    folder = drafter.save(tmp_path / "adapted")
    config, tensors = read_head(folder, "eagle")
    assert config["target"] == target_identity(target)
    assert config["training"]["online"]["updates"] == drafter.online.stats.updates
    assert config["training"]["base"] == read_head(heads["eagle"])[0]["training"]
    loaded = EagleDrafter(target, folder, dtype=torch.float32)
    for name, value in drafter.online.master.state_dict().items():
        assert torch.equal(loaded.head.state_dict()[name], value.to(torch.float16).to(value.dtype)), name
    original = read_head(heads["eagle"])[1]
    assert any(not torch.equal(tensors[k], original[k]) for k in original if k != "draft_vocab")  # it did adapt
    # Medusa and the merged drafter save the same way.
    medusa = MedusaDrafter(target, heads["medusa"], online=True)
    MedusaDrafter(target, medusa.save(tmp_path / "medusa"))
    merged = HeadNgramDrafter(EagleDrafter(target, heads["eagle"], online=True), sk.NgramDrafter())
    EagleDrafter(target, merged.save(tmp_path / "merged"))
    with pytest.raises(ValueError, match="another target"):
        EagleDrafter(tiny_model(5), folder)


def test_same_object_keeps_learning_across_calls(target):
    drafter = eagle(target, dict(interval=1, min_positions=4, batch=32, window=8, lr=3e-3))
    start = weights(drafter.head)
    ids, mask = left_pad(repetitive_prompts(2))
    sk.generate(target, ids, attention_mask=mask, drafter=drafter, max_new_tokens=12, adaptive=False)
    after_first = weights(drafter.head)
    updates, buffered = drafter.online.stats.updates, drafter.online.stats.buffered
    assert updates > 0 and buffered > 0
    assert any(not torch.equal(start[k], after_first[k]) for k in start)
    drafter.online.options.interval = 10**6  # no update in the second call: it must start where the first ended
    drafter.online._since = 0
    ids2, mask2 = left_pad(repetitive_prompts(1, seed=9))
    sk.generate(target, ids2, attention_mask=mask2, drafter=drafter, max_new_tokens=8, adaptive=False)
    assert all(torch.equal(after_first[k], v) for k, v in weights(drafter.head).items())
    assert drafter.online.stats.buffered > buffered  # the second call's rows joined the buffer


def test_default_drafter_online(target, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    assert isinstance(default_drafter(target, online=True), sk.ScoredMergedDrafter)  # no head: nothing to adapt
    train(target, tmp_path / "cache" / "heads", "eagle", VOCAB, steps=2, name="tiny-eagle")
    drafter = default_drafter(target, online=dict(interval=1, min_positions=4))
    assert isinstance(drafter, HeadNgramDrafter) and drafter.online is not None
    assert default_drafter(target).online is None
    ids, mask = left_pad(repetitive_prompts(3))
    out = sk.generate(target, ids, attention_mask=mask, drafter=drafter, max_new_tokens=20,
                      adaptive=free_planner(target, drafter))  # drafting (and so learning) whatever it costs here
    assert torch.equal(out.sequences, hf_greedy(target, ids, mask, 20))
    assert drafter.online.stats.updates > 0


def test_bad_settings(target, heads):
    for bad, match in ((dict(loss="mse"), "loss"), (dict(interval=0), "interval"), (dict(capacity=0), "capacity"),
                       (dict(lr=0.0), "lr"), (dict(explode_factor=1.5), "explode_factor"), (dict(bogus=1), "bogus"),
                       (dict(unroll=-1), "unroll"), (dict(prompt_steps=-1), "prompt_steps"),
                       (dict(prompt_lr=0.0), "prompt_lr"), (dict(backoff=0), "backoff"),
                       (dict(min_gain=1.0), "min_gain")):
        with pytest.raises(ValueError, match=match):
            EagleDrafter(target, heads["eagle"], online=bad)
    with pytest.raises(ValueError, match="online"):
        EagleDrafter(target, heads["eagle"], online="yes")
    with pytest.raises(ValueError, match="loss"):
        default_drafter(target, online={"loss": "mse"})
    assert OnlineOptions.coerce(False) is None and OnlineOptions.coerce(True) == OnlineOptions()


def test_online_stats_in_saved_config_are_json(target, heads, tmp_path):
    drafter = EagleDrafter(target, heads["eagle"], online=True)
    folder = drafter.save(tmp_path / "h")
    config = json.loads((folder / "config.json").read_text())
    assert config["training"]["online"]["options"]["loss"] == "kl"
    assert config["kind"] == "eagle"


# ----------------------------------------------------------------------------- benchmark


def test_bench_online_summary_settings_and_cli(tmp_path):
    """The benchmark's pieces that need no model: its settings parser, the summary ratios
    (ratios of sums over the prompts after the warm-up), the plot, and the CLI wiring."""
    import argparse

    from specdec_kernels.benchmarks import online as bench
    from specdec_kernels.cli import build_parser

    assert bench._online_settings("interval=4,lr=1e-4,loss=jsd,refresh_cache=true") == \
        {"interval": 4, "lr": 1e-4, "loss": "jsd", "refresh_cache": True}
    with pytest.raises(argparse.ArgumentTypeError, match="key=value"):
        bench._online_settings("interval")

    def arm(new, steps, seconds, **extra):
        return dict(new_tokens=new, steps=steps, seconds=seconds, tokens_per_step=new / steps, tokens_per_s=new / seconds,
                    step_tokens=[new // steps] * steps, **extra)

    rows = []
    for i, (f_steps, o_steps) in enumerate([(50, 50), (40, 30), (60, 40)]):
        rows.append({"config": {"workload": "chat", "index": i}, "identical": True,
                     "frozen": arm(60, f_steps, 10.0), "online": arm(60, o_steps, 12.0, update_s=1.2)})
    summary = bench.summarize(rows, warmup=1)["chat"]
    assert summary["prompts"] == 2
    assert summary["ratio_tokens_per_step"] == pytest.approx((120 / 70) / (120 / 100), abs=1e-4)
    assert summary["ratio_tokens_per_s"] == pytest.approx(10 / 12, abs=1e-4)
    assert summary["update_share"] == pytest.approx(0.1) and summary["identical"]
    if bench.common.pyplot() is not None:
        assert bench.plot(rows, tmp_path / "online.png").stat().st_size > 0
    args = build_parser().parse_args(["bench", "online", "--workloads", "chat", "--prompts", "3", "--online", "interval=4",
                                      "--head", "some/dir"])
    assert args.workloads == ("chat",) and args.prompts == 3 and args.online == {"interval": 4} and args.head == "some/dir"
    assert args.func.__name__ == "cmd_bench_online"


def test_bench_online_drafters(small_target_heads, tmp_path, monkeypatch):
    """`--drafter default` serves default_drafter (head + n-gram), `--drafter head` the head
    alone; both carry the online settings; an unknown kind or a folder without a head is a
    clear error."""
    from specdec_kernels.benchmarks import online as bench
    from specdec_kernels.cli import build_parser

    target, heads = small_target_heads
    for name, kind in (("eagle", EagleDrafter), ("medusa", MedusaDrafter)):
        alone = bench.make_drafter(target, "head", online={"interval": 3}, head=heads[name])
        assert isinstance(alone, kind) and alone.online.options.interval == 3
        merged = bench.make_drafter(target, "default", head=heads[name])
        assert isinstance(merged, HeadNgramDrafter) and merged.online is None
    with pytest.raises(ValueError, match="drafter: expected one of"):
        bench.make_drafter(target, "medusa", head=heads["eagle"])
    with pytest.raises(ValueError, match="not a head directory"):
        bench.make_drafter(target, "head", head=tmp_path)
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))  # no saved heads: none for this target
    with pytest.raises(ValueError, match="no trained head"):
        bench.make_drafter(target, "head")
    args = build_parser().parse_args(["bench", "online", "--drafter", "head"])
    assert args.drafter == "head"
    assert build_parser().parse_args(["bench", "online"]).drafter == "default"


def test_planner_step_times_leave_out_the_drafters_upkeep():
    """The step times the planner's cost model learns from leave out the drafter's upkeep
    (an online head's updates inside `propose`), while the trace keeps the wall time; a
    merged drafter sums its parts' upkeep; a duck-typed drafter without the method has none."""
    import time

    from specdec_kernels.loop.drafters import Drafter, MergedDrafter, upkeep_seconds
    from specdec_kernels.loop.generate import _Trace

    class Busy(Drafter):
        spent = 0.0

        def upkeep_seconds(self):
            return self.spent

    class Planner:
        def __init__(self):
            self.seen = []

        def observe_time(self, seconds):
            self.seen.append(seconds)

        def observe(self, out, active):
            pass

    drafter, planner = Busy(), Planner()
    trace = _Trace(planner, drafter)
    for step in range(4):
        trace.next_step()
        time.sleep(0.03)
        drafter.spent += 0.03  # the whole step was upkeep
        trace.records.append({"rows": 1})
    trace.next_step()
    walls = [r["seconds"] for r in trace.records]
    assert len(planner.seen) == 3 and all(w >= 0.03 for w in walls)
    assert all(s < 0.02 for s in planner.seen), planner.seen
    assert upkeep_seconds(MergedDrafter([drafter, Busy()])) == pytest.approx(drafter.spent)
    assert upkeep_seconds(object()) == 0.0


def test_online_head_reports_its_updates_as_upkeep(target):
    """An online head's upkeep is its update time; a frozen head's is 0."""
    drafter = eagle(target, dict(interval=1, min_positions=4, batch=16, window=8))
    sk.generate(target, torch.tensor([[5, 6, 7, 8, 9, 10]]), drafter=drafter, max_new_tokens=12, adaptive=False)
    assert drafter.online.stats.updates > 0
    assert drafter.upkeep_seconds() == pytest.approx(drafter.online.stats.update_seconds) and drafter.upkeep_seconds() > 0
    assert eagle(target, False).upkeep_seconds() == 0.0


def test_planner_starts_an_online_head_from_the_neutral_prior(target):
    """Between calls the planner carries what rows accepted per kind of drafter (the prior
    of the next call's rows). An online head (`learning`; also a merged drafter with one)
    starts every call from the neutral prior instead, and does not set the others' prior."""
    from specdec_kernels.loop.drafters import MergedDrafter
    from specdec_kernels.loop.planner import _LEARNED, Planner

    head = random_head(target, "eagle")
    frozen, online = eagle(target, False, head), eagle(target, True, head)
    assert online.learning and not frozen.learning
    assert MergedDrafter([online, sk.NgramDrafter()]).learning
    assert not MergedDrafter([frozen, sk.NgramDrafter()]).learning
    before = dict(_LEARNED)
    try:
        for drafter in (frozen, online):
            planner = Planner(verbose=False)
            planner.start(target, 1, drafter.max_nodes, torch.device("cpu"), drafter)
            planner.acceptance.rejected += 50.0  # this call's row rejected everything
            planner.finish()
        for drafter, prior in ((frozen, 0.05), (online, Planner().prior)):
            planner = Planner(verbose=False)
            planner.start(target, 1, drafter.max_nodes, torch.device("cpu"), drafter)
            assert float(planner.acceptance.alpha()[0]) == pytest.approx(prior), drafter.learning
    finally:
        _LEARNED.clear()
        _LEARNED.update(before)
