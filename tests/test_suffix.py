"""Suffix drafts: the stores (match, save, load, eviction, tenants, memory) and the drafter
through the engine (lossless in batches and dtypes, with the state drafter too, and a
repeated prompt drafts its earlier answer)."""
from __future__ import annotations

import tracemalloc

import pytest
import torch

from helpers import ARCHS, clone, random_prompts, tiny_model
from sot.drafters import NoDrafter, SuffixConfig, SuffixDrafter, SuffixStore, SuffixStores, TreeBudget
from sot.drafters.base import DraftInput
from sot.drafters.suffix import SuffixMatcher, grow_tree
from sot.engine import Engine, GenerationParams
from sot.errors import ConfigError
from sot.models.adapter import TargetModel
from sot.policy import PolicyConfig, PolicyKind

NEW = 40


def _tree_paths(tree) -> set[tuple[int, ...]]:
    paths: list[tuple[int, ...]] = [()]
    for i in range(1, tree.size):
        paths.append(paths[tree.parents[i]] + (tree.tokens[i],))
    return set(paths[1:])


def test_longest_match_and_counts() -> None:
    """The module's example: two stored answers share ``b c``; a context ending in ``b c``
    gets both continuations at 1/2, one ending in ``a b c`` only the first, at 1."""
    store = SuffixStore(SuffixConfig(prompt_tail=0))
    store.add([], [1, 2, 3, 4])
    store.add([], [9, 2, 3, 5])
    both = SuffixMatcher(store.config, store).tree([7, 2, 3], 8, 4)
    assert both.tokens[0] == 3 and sorted(both.tokens[1:]) == [4, 5] and both.draft_probs == [1.0, 0.5, 0.5]
    one = SuffixMatcher(store.config, store).tree([1, 2, 3], 8, 4)
    assert one.tokens == [3, 4] and one.draft_probs == [1.0, 1.0]
    assert SuffixMatcher(store.config, store).tree([7, 8, 3], 8, 4).size == 1  # only 1 token matches


def test_grow_tree_is_best_first_and_respects_the_floor() -> None:
    conts = [[1, 2], [1, 2], [1, 3], [4]]
    tree = grow_tree(0, conts, max_nodes=10, min_prob=0.3)
    # 1 (3/4), then 1->2 (2/4); 1->3 and 4 (1/4) fall under the floor
    assert tree.tokens == [0, 1, 2] and tree.parents == [-1, 0, 1]
    assert grow_tree(0, conts, max_nodes=2, min_prob=0.0).tokens == [0, 1]


def test_match_length_bounds_the_depth() -> None:
    """A match of m tokens speculates at most max_spec_factor * m deep."""
    store = SuffixStore(SuffixConfig(prompt_tail=0, max_spec_factor=1.0))
    store.add([], list(range(10, 40)))
    short = SuffixMatcher(store.config, store).tree([5, 10, 11], 16, 12)  # matches 10 11: 2 tokens
    assert short.max_depth == 2
    long = SuffixMatcher(store.config, store).tree([10, 11, 12, 13, 14, 15], 16, 12)  # 6 tokens
    assert long.max_depth == 6


def test_own_context_is_matched_without_the_store() -> None:
    m = SuffixMatcher(SuffixConfig(), None)
    ctx = [1, 2, 3, 4, 5, 6, 1, 2, 3]
    assert m.tree(ctx, 8, 8).tokens[:4] == [3, 4, 5, 6]
    with pytest.raises(ValueError):
        m.tree(ctx[:4], 8, 8)  # a matcher follows one growing context


def test_savers_of_one_file_never_share_a_temporary_file(tmp_path) -> None:
    """Two savers of one path (two SoT objects of a process, say) each write a file of their
    own and rename it: every save succeeds and the file left is one of them, whole and
    readable by its owner alone (it holds earlier answers)."""
    import os
    import threading

    path = tmp_path / "shared.npz"
    stores = [SuffixStores(), SuffixStores()]
    for i, st in enumerate(stores):
        st.get(None).add([i], list(range(10 + i, 60 + i)))
    errors: list[BaseException] = []

    def save(st: SuffixStores) -> None:
        try:
            for _ in range(15):
                st.save(path)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=save, args=(st,)) for st in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    back = SuffixStores()
    back.load(path)
    assert back.get(None).all_sequences() in [st.get(None).all_sequences() for st in stores]
    assert os.stat(path).st_mode & 0o077 == 0 and [p.name for p in tmp_path.iterdir()] == ["shared.npz"]


def test_store_save_and_load_round_trip(tmp_path) -> None:
    stores = SuffixStores(per_tenant=True)
    stores.get("a").add([1, 2], [3, 4, 5])
    stores.get("b").add([6], [7, 8])
    stores.get(None).add([], [9, 10])
    path = tmp_path / "answers.store"
    stores.save(path)
    loaded = SuffixStores(per_tenant=True)
    loaded.load(path)
    for tenant in ("a", "b", None):
        assert loaded.get(tenant).all_sequences() == stores.get(tenant).all_sequences()
    (tmp_path / "bad").write_text("not a store")
    with pytest.raises(ConfigError, match="is not a suffix store written by SoT"):
        SuffixStores().load(tmp_path / "bad")


def _store_file(path, tokens, lengths, owners=None, tenants=("",), **extra) -> None:
    import numpy as np

    owners = [0] * len(lengths) if owners is None else owners
    with open(path, "wb") as fh:
        np.savez_compressed(fh, tokens=np.asarray(tokens), lengths=np.asarray(lengths), owners=np.asarray(owners),
                            tenants=np.asarray(tenants, dtype=str), **extra)


def test_store_files_are_checked_written_whole_and_read_within_the_cap(tmp_path, monkeypatch) -> None:
    """A damaged or foreign file is a ConfigError, never a crash in a verify pass (token ids
    beyond the vocabulary) or a raw library error; a save stopped midway leaves the old file;
    reading keeps the newest answers within the cap; per-tenant files stay per tenant."""
    import numpy as np

    path = tmp_path / "s.store"
    good = SuffixStores(vocab_size=64)
    good.get(None).add([1, 2], [3, 4, 5])
    good.save(path)
    whole = path.read_bytes()
    link = tmp_path / "link.store"  # saving through a symbolic link writes the file it names, the link kept
    link.symlink_to(path)
    good.get(None).add([7], [8, 9])
    good.save(link)
    assert link.is_symlink() and path.read_bytes() != whole
    good = SuffixStores(vocab_size=64)  # (the store of one answer again, for what follows)
    good.get(None).add([1, 2], [3, 4, 5])
    good.save(path)
    whole = path.read_bytes()
    for name, damage in (("truncated", whole[: len(whole) // 2]), ("flipped", whole[:60] + bytes(40) + whole[100:])):
        (tmp_path / name).write_bytes(damage)
        with pytest.raises(ConfigError, match="is not a suffix store written by SoT"):
            SuffixStores().load(tmp_path / name)
    for name, kwargs in (("floats", dict(tokens=[1.5, 2.0], lengths=[2])), ("sums", dict(tokens=[1, 2], lengths=[3])),
                         ("negative", dict(tokens=[1, 2], lengths=[3, -1], owners=[0, 0])),
                         ("owner", dict(tokens=[1, 2], lengths=[2], owners=[3])),
                         ("flat", dict(tokens=[[1, 2]], lengths=[2]))):
        _store_file(tmp_path / name, **kwargs)
        with pytest.raises(ConfigError, match="is not a suffix store written by SoT"):
            SuffixStores().load(tmp_path / name)
    _store_file(tmp_path / "foreign", tokens=[5, 70, 3], lengths=[3])  # an id past this vocabulary
    with pytest.raises(ConfigError, match="token ids outside this model's 64"):
        SuffixStores(vocab_size=64).load(tmp_path / "foreign")
    with pytest.raises(ConfigError, match="a model with 64 tokens, this one has 96"):
        SuffixStores(vocab_size=96).load(path)
    # a store records its tokenizer: another one's ids are refused, the same one's (or a file
    # that names none, written before) read
    named = SuffixStores(vocab_size=64, tokenizer="aaaa")
    named.get(None).add([1, 2], [3, 4, 5])
    named.save(tmp_path / "named.store")
    with pytest.raises(ConfigError, match="another tokenizer's token ids"):
        SuffixStores(vocab_size=64, tokenizer="bbbb").load(tmp_path / "named.store")
    for reader, file in ((SuffixStores(vocab_size=64, tokenizer="aaaa"), "named.store"),
                         (SuffixStores(vocab_size=64, tokenizer="bbbb"), "s.store")):
        reader.load(tmp_path / file)
        assert reader.get(None).all_sequences() == good.get(None).all_sequences()
    tenants = SuffixStores(per_tenant=True)
    tenants.get("alice").add([], [1, 2, 3])
    tenants.save(tmp_path / "tenants.store")
    with pytest.raises(ConfigError, match="stores of 1 tenants, kept apart"):
        SuffixStores().load(tmp_path / "tenants.store")

    def fails(fh, **arrays):  # a disk that fills midway
        fh.write(b"PK partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(np, "savez_compressed", fails)
    with pytest.raises(OSError):
        good.save(path)
    monkeypatch.undo()
    assert path.read_bytes() == whole and [p.name for p in tmp_path.iterdir() if p.name.endswith(".part")] == []
    # over the cap, the newest answers are read, and no more than the cap is ever indexed
    _store_file(tmp_path / "big", tokens=list(range(50)) * 10, lengths=[100] * 5)
    small = SuffixStores(SuffixConfig(max_tokens=150))
    small.load(tmp_path / "big")
    assert small.tokens == 150 and small.get(None).all_sequences() == [list(range(50)), list(range(50)) * 2]


def test_the_cap_holds_for_all_tenants_together() -> None:
    """Clients choose their ``user``, so the cap bounds every tenant's store together: past it
    the largest store forgets its oldest answer."""
    stores = SuffixStores(SuffixConfig(max_tokens=100, prompt_tail=0), per_tenant=True)
    for i in range(40):
        stores.get(f"user{i % 8}").add([], [i] * 10)
        assert stores.tokens <= 100
    assert len([s for s in stores.stores.values() if s.tokens]) == 8  # each keeps its newest answer


def test_eviction_keeps_the_store_under_its_cap() -> None:
    store = SuffixStore(SuffixConfig(max_tokens=100, prompt_tail=0))
    for i in range(30):
        store.add([], [1000 + i] * 3 + [7, 8, 9])
        assert store.tokens <= 100
    seqs = store.all_sequences()
    assert seqs[-1][0] == 1029 and seqs[0][0] == 1029 - len(seqs) + 1  # oldest first out
    # evicted answers draft nothing; kept ones still do
    assert SuffixMatcher(store.config, store).tree([5, 1000, 1000], 4, 3).size == 1
    assert 1029 in SuffixMatcher(store.config, store).tree([5, 1029, 1029], 4, 3).tokens[1:]


def test_eviction_leaves_the_index_of_the_kept_answers() -> None:
    """Evicting an answer drops its index entries at once: after heavy churn the index holds
    exactly what indexing the kept answers afresh gives, so nothing stale is kept and no
    rebuild is ever due."""
    store = SuffixStore(SuffixConfig(max_tokens=500, prompt_tail=0))
    gen = torch.Generator().manual_seed(0)
    for i in range(300):  # few distinct tokens: many K-grams occur often, in many answers
        store.add([], torch.randint(0, 12 if i % 2 else 400, (int(torch.randint(1, 40, (1,), generator=gen)),),
                                    generator=gen).tolist())
        assert store.tokens <= 500

    def entries(index) -> dict:
        first = min(index.seqs)
        out = {}
        for key, found in index.index.items():
            found = [found] if isinstance(found, int) else list(found)
            out[key] = [((p >> 32) - first, p & 0xFFFFFFFF) for p in found]
        return out

    fresh = SuffixStore(store.config)
    for seq in store.all_sequences():
        fresh._add(seq)
    assert entries(store._index) == entries(fresh._index)
    with pytest.raises(ValueError, match="newest"):  # positions stay in order: only the newest grows
        store._index.extend(min(store._index.seqs), [1, 2])


def test_memory_stays_under_the_cap() -> None:
    """Filling a store far past its cap holds memory at the cap's worth (about 100 bytes a
    token held), however many tokens went through it."""
    cap = 20_000
    store = SuffixStore(SuffixConfig(max_tokens=cap))
    gen = torch.Generator().manual_seed(0)
    answers = [torch.randint(0, 5000, (200,), generator=gen).tolist() for _ in range(40)]
    tracemalloc.start()
    for rnd in range(10):  # 80k tokens in, 20k kept
        for a in answers:
            store.add([rnd], a)
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert store.tokens <= cap
    assert held < 400 * cap, f"{held / cap:.0f} bytes a token held"


def test_tenants_are_kept_apart() -> None:
    """With per-tenant stores one tenant's answers never draft another's; shared, they do."""
    answer = list(range(100, 130))
    ctx = [5, 6, 7, 100, 101, 102]
    for per_tenant, other_drafts in ((True, False), (False, True)):
        drafter = SuffixDrafter(SuffixStores(per_tenant=per_tenant))
        drafter.remember([5, 6, 7], answer, tenant="alice")
        mine = drafter.propose([DraftInput(0, ctx, tenant="alice")], TreeBudget())[0]
        theirs = drafter.propose([DraftInput(1, ctx, tenant="bob")], TreeBudget())[0]
        assert mine.tokens[1:4] == [103, 104, 105]
        assert (theirs.size > 1) == other_drafts


def _perturbed(outputs: list[list[int]], every: int) -> list[list[int]]:
    """The outputs with every ``every``-th token changed: drafts from them are partly wrong."""
    return [[t if (i + 1) % every else (t + 1) % 64 for i, t in enumerate(o)] for o in outputs]


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_suffix_drafter_is_lossless(arch: str, dtype: torch.dtype) -> None:
    """Drafts from a store of partly wrong earlier answers are accepted and rejected, in a
    batch of 3 and alone, and the output equals plain decoding's."""
    target = TargetModel(clone(tiny_model(arch), dtype))
    prompts = random_prompts((7, 30, 75), seed=1)
    params = GenerationParams(max_new_tokens=NEW)
    plain = [r.token_ids for r in Engine(target, NoDrafter()).generate(prompts, params)]

    def drafter() -> SuffixDrafter:
        d = SuffixDrafter()
        for p, o in zip(prompts, _perturbed(plain, 6)):
            d.remember(p, o)
        return d

    # every drafted tree verified whole: which drafts a cost-based policy keeps depends on this
    # machine's measured pass times, and the point here is drafts accepted and rejected
    static = PolicyConfig(kind=PolicyKind.STATIC)
    batch = Engine(target, drafter(), TreeBudget(16, 6), policy=static).generate(prompts, params)
    assert [r.token_ids for r in batch] == plain
    assert sum(sum(r.accept_lengths) - r.steps for r in batch) > NEW // 2, "drafts should be accepted"
    assert any(a < d + 1 for r in batch for a, d in zip(r.accept_lengths, [s - 1 for s in r.tree_sizes])), \
        "some drafts should be rejected"
    alone = [Engine(target, drafter(), TreeBudget(16, 6), policy=static).generate([p], params)[0].token_ids
             for p in prompts]
    assert alone == plain


def test_a_repeated_prompt_drafts_its_earlier_answer() -> None:
    target = TargetModel(tiny_model("llama"))
    prompt = random_prompts((20,), seed=4)[0]
    params = GenerationParams(max_new_tokens=NEW)
    engine = Engine(target, SuffixDrafter(), TreeBudget(16, 8))
    first = engine.generate([prompt], params)[0]
    second = engine.generate([prompt], params)[0]
    assert second.token_ids == first.token_ids
    # the whole answer comes from the store: near max_depth + 1 tokens a step
    assert second.steps <= NEW // 4 < first.steps
    tree = SuffixDrafter(engine.drafter.stores).propose([DraftInput(0, prompt)], TreeBudget(16, 8))[0]
    assert tuple(first.token_ids[:4]) in _tree_paths(tree)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_state_drafter_with_suffix_trees_is_lossless(dtype: torch.dtype) -> None:
    """The default drafter's combination: predictor trees, prompt lookup and suffix trees."""
    from sot.drafters.state import StateDrafter, new_predictor

    layers = (0, 1, 2)
    model = clone(tiny_model("llama"), dtype)
    target = TargetModel(model, state_layers=layers)
    prompts = random_prompts((7, 30, 75), seed=2)
    params = GenerationParams(max_new_tokens=30)
    plain = [r.token_ids for r in Engine(target, NoDrafter()).generate(prompts, params)]
    stores = SuffixStores()
    for p, o in zip(prompts, _perturbed(plain, 5)):
        stores.get(None).add(p, o)
    drafter = StateDrafter(new_predictor(model, layers, None, seed=1), top_k=3, suffix=stores)
    batch = Engine(target, drafter, TreeBudget(16, 6)).generate(prompts, params)
    assert [r.token_ids for r in batch] == plain
    assert sum(sum(r.accept_lengths) - r.steps for r in batch) > 30
    alone = [Engine(target, drafter, TreeBudget(16, 6)).generate([p], params)[0].token_ids for p in prompts]
    assert alone == plain


def test_many_tenants_leave_no_empty_stores_behind() -> None:
    """Clients choose their ``user``: stores evicted to nothing are dropped, a request that
    only reads makes no store, and the bookkeeping stays the size of the stores kept."""
    stores = SuffixStores(SuffixConfig(max_tokens=200, prompt_tail=0), per_tenant=True)
    for i in range(3000):
        stores.get(f"user{i}").add([], [i % 50, 7, 8, 9, 10])
        assert stores.tokens == sum(s.tokens for s in stores.stores.values()) <= 200
    assert len(stores.stores) <= 40 and len(stores._heap) <= 2 * len(stores.stores) + 65
    assert stores.find("nobody") is None and "nobody" not in stores.stores


def test_a_request_sees_its_tenants_store_once_it_exists() -> None:
    """A request that began before its tenant had a store drafts from it once it is made; an
    answer aborted before its first token makes no store."""
    from sot.drafters.free import FreeDrafts

    stores = SuffixStores(SuffixConfig(prompt_tail=0), per_tenant=True)
    free = FreeDrafts(lookup=False, suffix=stores)
    context = [5, 6, 7, 8]
    assert free.suffix_tree(DraftInput(0, context, tenant="ann"), 8, 4) is None  # no store yet
    free.remember([1], [], "bob")
    assert "bob" not in stores.stores
    stores.get("ann").add([], [7, 8, 9, 10, 11])
    tree = free.suffix_tree(DraftInput(0, context + [9, 10, 11, 7, 8], tenant="ann"), 8, 4)
    assert tree is not None and 9 in tree.tokens


def test_the_tokenizer_fingerprint_follows_the_vocabulary() -> None:
    """What a store file records of its tokenizer: the same for the same token texts and ids
    in any order, another for another mapping; ``None`` where the tokenizer lists none."""
    from sot.fingerprint import tokenizer_hash

    class Vocab:
        def __init__(self, vocab: dict) -> None:
            self.vocab = vocab

        def get_vocab(self) -> dict:
            return self.vocab

    one = tokenizer_hash(Vocab({"a": 0, "b": 1, "\u00e9": 2}))
    assert one == tokenizer_hash(Vocab({"\u00e9": 2, "b": 1, "a": 0}))
    assert one != tokenizer_hash(Vocab({"a": 1, "b": 0, "\u00e9": 2}))
    assert tokenizer_hash(object()) is None


def test_match_rates_are_kept_by_match_length_and_depth() -> None:
    """Free drafts behind a long match are priced by what such drafts did: the chance at depth
    ``d`` given ``1..d-1`` matched, per band of match lengths; a depth no step has reached yet
    leans on the shallower depths measured, and a node's chance is the product down to it."""
    from sot.drafters.pld import MatchRates

    rates = MatchRates(prior=0.5, prior_tries=2.0)
    assert rates.confidences(40, 3) == pytest.approx([1.0, 0.5, 0.25, 0.125]), "no counts: the prior"
    for _ in range(30):  # copies: eight tokens matched, then the ninth tried and missed
        rates.record(40, 8, 9)
    for _ in range(30):  # weak matches: the first token misses
        rates.record(2, 0, 1)
    long, weak = rates.confidences(40, 12), rates.confidences(2, 3)
    assert rates.rate(40, 1) > 0.9 and rates.rate(2, 1) < 0.1
    assert long[8] > 0.5 > weak[1], "a long match's eighth token beats a weak match's first"
    assert rates.rate(40, 9) < rates.rate(40, 5), "depth 9 missed every time it was tried"
    assert rates.rate(40, 17) == pytest.approx((2.0 * rates.rate(40, 9)) / 2.0), "unreached: the band above"
    assert all(a >= b for a, b in zip(long, long[1:])) and long[0] == 1.0
    assert rates.rate(8, 1) == pytest.approx(0.5), "another band of match lengths keeps its own counts"
    for _ in range(1000):
        rates.record(40, 8, 9)
    assert max(max(row) for row in rates.tries) < rates.window, "old counts fade"


def test_lookup_measures_its_match_and_new_sequences_start_from_learned_rates() -> None:
    """The lookup's match length runs back past its n-gram (a copy in progress is told from a
    repeated phrase), and the rates a sequence learned price the next sequence's drafts."""
    from sot.drafters.free import FreeDrafts
    from sot.drafters.pld import NgramIndex

    text = list(range(100, 200))
    index = NgramIndex(8)
    assert index.best(text + [7, 8, 9] + text[:30], 4) == text[30:34] and index.match == 30
    assert index.best(text + [7, 8, 9] + text[:30] + [5, 6, 8, 9], 2) == text[:2] and index.match == 2

    free = FreeDrafts(lookup=True)
    budget = TreeBudget(32, 24)
    ctx, pos = text + [1, 2] + text[:20], 20
    first = free.free_tree(DraftInput(0, ctx), budget)
    assert first.draft_probs[1:4] == pytest.approx([0.5, 0.25, 0.125]), "nothing learned yet"
    for _ in range(8):  # the copy goes on: eight tokens a step, each what the draft said
        ctx, pos = ctx + text[pos:pos + 8], pos + 8
        free.free_tree(DraftInput(0, ctx), budget)
    free.release(0)
    later = free.free_tree(DraftInput(1, [9] + text + [3] + text[:40]), budget)
    assert later.size > 8 and later.draft_probs[8] > 0.6, "a new sequence prices a copy as copies went"


def test_a_prediction_is_drafted_from_and_never_changes_the_answer() -> None:
    """Predicted Outputs: the tokens a request expects its answer to repeat are copied from
    as the context is, by every drafter with free drafts (here prompt lookup alone, which keeps
    no store of earlier answers), so the same answer takes far fewer steps; a prediction with
    nothing of the answer, or one that is not token ids, changes nothing or is refused."""
    from sot.drafters import make_drafter

    model = tiny_model("llama", seed=5)
    target = TargetModel(clone(model, torch.float32))
    prompt = random_prompts((12,), seed=9)[0]
    params = GenerationParams(max_new_tokens=48)
    alone = Engine(target, NoDrafter()).generate([prompt], params)[0]
    no_fallback = PolicyConfig(kind=PolicyKind.HEURISTIC, fallback_threshold=0.0)
    runs = {}
    for name, prediction in (("none", ()), ("answer", tuple(alone.token_ids)), ("other", tuple(range(40, 80)))):
        engine = Engine(target, make_drafter("pld", None), TreeBudget(32, 24), policy=no_fallback)
        res = engine.generate([prompt], GenerationParams(max_new_tokens=48, prediction=prediction))[0]
        assert res.token_ids == alone.token_ids, name
        runs[name] = res.steps
    assert runs["answer"] * 3 <= runs["none"], runs
    # in a batch too, each answer is the one it has alone, the prediction drafted from as it grows
    other = random_prompts((15,), seed=4)[0]
    both = [r.token_ids for r in Engine(target, NoDrafter()).generate([prompt, other], params)]
    engine = Engine(target, make_drafter("pld", None), TreeBudget(32, 24), policy=no_fallback)
    batch = engine.generate([prompt, other], GenerationParams(max_new_tokens=48, prediction=tuple(alone.token_ids)),
                            batch_size=2)
    assert [r.token_ids for r in batch] == both
    assert batch[0].steps * 3 <= runs["none"], (batch[0].steps, runs)
    with pytest.raises(ConfigError, match="prediction must be a list of token ids"):
        Engine(target, NoDrafter()).generate([prompt], GenerationParams(max_new_tokens=4, prediction=("a",)))
    with pytest.raises(ConfigError, match="more than the model's context"):
        Engine(target, NoDrafter()).generate([prompt], GenerationParams(max_new_tokens=4, prediction=(5,) * 10**5))
