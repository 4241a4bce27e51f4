"""loop.memory.weights_in_huge_pages: a CPU model's large weights moved into transparent huge pages.

The move must change nothing but where the bytes live: every value, shape, dtype and
`requires_grad` as before, tied parameters still one tensor, small parameters left alone,
and `generate` (which moves CPU targets by default) still equal to HF's greedy output. The
region must really be eligible for 2 MB pages (the kernel's own word, /proc/self/smaps), a
second call must move nothing, and a machine whose mode is "never" must be left alone.
"""

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import specdec_kernels as sk  # noqa: E402
from specdec_kernels import config  # noqa: E402
from specdec_kernels.loop import memory  # noqa: E402

VOCAB = 512
THP = memory.transparent_huge_pages() in ("always", "madvise")
needs_thp = pytest.mark.skipif(not THP, reason="transparent huge pages off or unknown on this machine")


def tiny_llama(seed: int = 0, tie: bool = True):
    """~5 MB of weights: products of 128-512 KB (moved), norms of 1 KB (kept)."""
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=tie, bos_token_id=None, eos_token_id=None)
    return transformers.LlamaForCausalLM(cfg).eval()


def smaps_entry(address: int) -> dict:
    """The /proc/self/smaps fields of the mapping that holds `address`."""
    entry, inside = {}, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: start-end perms ...
            if inside:
                return entry
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside:
            key, _, value = line.partition(":")
            entry[key] = value.strip()
    return entry


@needs_thp
def test_weights_move_and_keep_their_values():
    model = tiny_llama(tie=True)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    grads = {name: p.requires_grad for name, p in model.named_parameters()}
    small = model.model.norm.weight
    small_ptr = small.data_ptr()
    moved = memory.weights_in_huge_pages(model)
    big = [p for p in model.parameters() if p.numel() * p.element_size() >= memory.MIN_BYTES]
    assert moved >= sum(p.numel() * p.element_size() for p in big) > 0
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
        assert p.requires_grad == grads[name] and isinstance(p, torch.nn.Parameter), name
    # Tied: still one tensor. Small parameters: where they were.
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert small.data_ptr() == small_ptr
    # Every moved parameter inside one region, on cache-line boundaries, the region on a 2 MB one.
    (start, end), = getattr(model, "_specdec_huge_page_regions")
    assert start % memory.HUGE_PAGE == 0
    for p in big:
        assert start <= p.data_ptr() < end and p.data_ptr() % 64 == 0
    # The kernel's word: the mapping may take huge pages (THPeligible, Linux >= 5.x), advised so.
    entry = smaps_entry(start)
    if "THPeligible" in entry:
        assert entry["THPeligible"] == "1"
    assert "hg" in entry.get("VmFlags", "hg").split()
    # Two Parameters over one storage (tied by hand) still share it.
    by_hand = torch.nn.Module()
    by_hand.a = torch.nn.Parameter(torch.randn(1024, 1024))
    by_hand.b = torch.nn.Parameter(by_hand.a.data)
    assert memory.weights_in_huge_pages(by_hand) > 0
    assert by_hand.a.data_ptr() == by_hand.b.data_ptr() != 0
    by_hand.a.data.add_(1)
    assert torch.equal(by_hand.a, by_hand.b)
    # A second call moves nothing; new tensors (a dtype change) are moved again.
    assert memory.weights_in_huge_pages(model) == 0
    model.to(torch.float64)
    assert memory.weights_in_huge_pages(model) > 0
    assert all(torch.equal(p, before[name].double()) for name, p in model.named_parameters())


def test_never_mode_and_small_modules_are_left_alone(monkeypatch):
    model = tiny_llama()
    ptrs = [p.data_ptr() for p in model.parameters()]
    monkeypatch.setattr(memory, "transparent_huge_pages", lambda: "never")
    assert memory.weights_in_huge_pages(model) == 0
    monkeypatch.setattr(memory, "transparent_huge_pages", lambda: None)  # not Linux
    assert memory.weights_in_huge_pages(model) == 0
    assert [p.data_ptr() for p in model.parameters()] == ptrs
    monkeypatch.setattr(memory, "transparent_huge_pages", lambda: "madvise")
    assert memory.weights_in_huge_pages(torch.nn.LayerNorm(64)) == 0  # nothing large enough

    def no_memory(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    with monkeypatch.context() as patch:  # the region cannot be mapped: the weights stay where they are
        patch.setattr(memory.mmap, "mmap", no_memory)
        assert memory.huge_page_buffer(1 << 22) is None
        assert memory.weights_in_huge_pages(model) == 0
        assert [p.data_ptr() for p in model.parameters()] == ptrs
    one_mb = torch.nn.Linear(512, 512)  # large enough, but not one whole huge page
    ptr = one_mb.weight.data_ptr()
    assert memory.weights_in_huge_pages(one_mb) == 0 and one_mb.weight.data_ptr() == ptr

    class Wrapped(torch.Tensor):  # a tensor subclass (as quantized weights are): never replaced by a plain tensor
        pass

    odd = torch.nn.Module()
    odd.weight = torch.nn.Parameter(torch.randn(1024, 1024).as_subclass(Wrapped))  # 4 MB
    odd.view = torch.nn.Parameter(torch.randn(2048, 1024)[1:])  # a view from an offset: stays with its storage
    ptrs = [p.data_ptr() for p in odd.parameters()]
    assert memory.weights_in_huge_pages(odd) == 0
    assert [p.data_ptr() for p in odd.parameters()] == ptrs and isinstance(odd.weight.data, Wrapped)


@needs_thp
@pytest.mark.parametrize("enabled", [True, False])
def test_generate_moves_cpu_targets(monkeypatch, enabled):
    monkeypatch.setattr(config, "huge_pages", enabled)
    model = tiny_llama(seed=1)
    prompt = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    want = model.generate(prompt, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    ptr = model.model.layers[0].mlp.up_proj.weight.data_ptr()
    out = sk.generate(model, prompt, drafter=sk.NgramDrafter(num_tokens=4), max_new_tokens=16, temperature=0)
    assert torch.equal(out.sequences, want)
    regions = getattr(model, "_specdec_huge_page_regions", [])
    moved = model.model.layers[0].mlp.up_proj.weight.data_ptr() != ptr
    assert moved == enabled and (len(regions) == 1) == enabled
    # And again on the moved weights: same output, nothing moved twice.
    again = sk.generate(model, prompt, drafter=sk.NgramDrafter(num_tokens=4), max_new_tokens=16, temperature=0)
    assert torch.equal(again.sequences, want)
    assert len(getattr(model, "_specdec_huge_page_regions", [])) == len(regions)
