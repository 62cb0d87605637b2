"""BlockManager without a model (no torch): allocation, reference counts, prefix-cache hashing and
lookup, LRU eviction under pressure, and the uncommitted blocks of a failed step."""

from __future__ import annotations

from proxy.engine.block_manager import BlockManager, hash_block
from proxy.engine.request import Request
from proxy.sampling import SamplingParams

P = SamplingParams(max_tokens=4, temperature=0.0)


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), P)


def admit(bm: BlockManager, r: Request) -> int:
    """Schedule the whole of ``r`` after its cached prefix, as the scheduler does; returns the hit tokens."""
    cached = bm.find_cached_prefix(r)
    n = r.num_tokens - len(cached) * bm.block_size
    assert bm.allocate_slots(r, n, cached)
    bm.cache_full_blocks(r, r.num_computed_tokens + n)
    r.num_computed_tokens += n
    return len(cached) * bm.block_size


def test_hashes_are_chained_over_the_prefix() -> None:
    bm = BlockManager(16, 4)
    a = req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    b = req("b", [1, 2, 3, 4, 5, 6, 7, 8])
    c = req("c", [9, 2, 3, 4, 5, 6, 7, 8])  # first block differs, second block's tokens equal
    ha, hb, hc = list(bm.block_hashes(a)), bm.block_hashes(b), bm.block_hashes(c)
    assert len(ha) == 2 and ha == hb  # only full blocks are hashed
    assert ha[0] == hash_block(b"", [1, 2, 3, 4]) and ha[1] == hash_block(ha[0], [5, 6, 7, 8])
    assert hc[0] != ha[0] and hc[1] != ha[1]  # same tokens, different parent
    a.all_token_ids += [10, 11, 12]
    assert len(bm.block_hashes(a)) == 3 and a.block_hashes[:2] == ha  # extended in place


def test_shared_prefix_reference_counts_and_last_token_rule() -> None:
    bm = BlockManager(16, 4)
    a = req("a", list(range(10, 20)))  # 10 tokens: 2 full blocks + 2
    assert admit(bm, a) == 0
    assert bm.num_cached_blocks == 2 and bm.num_free_blocks == 13
    b = req("b", list(range(10, 20)) + [99])
    assert admit(bm, b) == 8
    assert b.block_ids[:2] == a.block_ids[:2] and b.block_ids[2] != a.block_ids[2]
    assert [bm.ref_count(x) for x in a.block_ids] == [2, 2, 1]
    assert bm.num_free_blocks == 12
    # a prompt that is exactly two cached blocks still computes its last token: one block hit
    c = req("c", list(range(10, 18)))
    assert bm.find_cached_prefix(c) == a.block_ids[:1]
    bm.free(a)
    assert [bm.ref_count(x) for x in b.block_ids] == [1, 1, 1]
    bm.free(b)
    assert bm.num_free_blocks == 16 and bm.usage == 0.0
    # freed blocks keep their contents: a later request still hits them
    d = req("d", list(range(10, 20)) + [5, 6])
    assert admit(bm, d) == 8


def test_uncached_free_blocks_are_taken_before_cached_ones_and_eviction_is_lru() -> None:
    bm = BlockManager(6, 2)
    old = req("old", [1, 2, 3, 4, 5])  # blocks (1,2) (3,4) cached, (5) not
    new = req("new", [7, 8, 9])  # block (7,8) cached
    admit(bm, old)
    admit(bm, new)
    bm.free(old)
    bm.free(new)
    assert bm.num_free_blocks == 6 and bm.num_cached_blocks == 3
    filler = req("f", [50, 51, 52, 53, 54])  # needs 3 blocks: the 3 without contents first
    assert bm.allocate_slots(filler, 5)
    assert bm.num_cached_blocks == 3
    more = req("m", [60, 61])  # 1 block: evicts the least recently freed cached block
    assert bm.allocate_slots(more, 2)
    assert bm.num_cached_blocks == 2
    # "old" was freed first, its tail first: its second block went; its first and "new"'s remain
    assert len(bm.find_cached_prefix(req("x", [1, 2, 3, 4, 0]))) == 1
    assert len(bm.find_cached_prefix(req("y", [7, 8, 0]))) == 1


def test_allocation_counts_free_cached_blocks_it_takes_back() -> None:
    bm = BlockManager(3, 2)
    a = req("a", [1, 2, 3, 4, 5])
    admit(bm, a)
    bm.free(a)
    b = req("b", [1, 2, 3, 4, 6])
    cached = bm.find_cached_prefix(b)
    assert len(cached) == 2
    hog = req("hog", [40])
    assert bm.allocate_slots(hog, 1)  # the block without contents
    # b needs its 2 cached blocks (free, so they count) + 1 new: only 2 free -> refused, nothing taken
    assert not bm.allocate_slots(b, 1, cached)
    assert b.block_ids == [] and b.num_computed_tokens == 0 and bm.num_free_blocks == 2
    bm.free(hog)
    assert bm.allocate_slots(b, 1, cached)
    assert b.num_computed_tokens == 4 and b.block_ids[:2] == cached and bm.num_free_blocks == 0


def test_failed_step_blocks_are_never_served() -> None:
    bm = BlockManager(8, 2)
    a = req("a", [1, 2, 3, 4, 5])
    admit(bm, a)
    bm.commit()  # a's step succeeded
    b = req("b", [1, 2, 3, 4, 8, 9, 10])
    assert admit(bm, b) == 4  # (8, 9) is registered, uncommitted
    assert bm.num_cached_blocks == 3
    bm.uncache_uncommitted()  # b's step failed
    bm.free(b)
    assert bm.num_cached_blocks == 2
    assert len(bm.find_cached_prefix(req("c", [1, 2, 3, 4, 8, 9, 10]))) == 2
    # the block that lost its hash is reused before any cached block
    before = bm.num_cached_blocks
    d = req("d", [70, 71])
    assert bm.allocate_slots(d, 2)
    assert bm.num_cached_blocks == before


def test_disabled_prefix_caching_shares_nothing() -> None:
    bm = BlockManager(8, 2, enable_prefix_caching=False)
    a = req("a", [1, 2, 3, 4, 5])
    admit(bm, a)
    assert bm.num_cached_blocks == 0
    assert bm.find_cached_prefix(req("b", [1, 2, 3, 4, 5])) == []


def test_output_blocks_hash_apart_with_their_prompt_length() -> None:
    """With ``output_blocks_apart`` a block holding output tokens is keyed by the prompt length too:
    the same tokens as a prompt's, or as another request's whose prompt ends elsewhere in the block,
    are other K/V (written by the decode path)."""
    from proxy.engine.block_manager import output_marker

    bm = BlockManager(16, 4, output_blocks_apart=True)
    a = Request("a", [1, 2, 3, 4, 5, 6], P)  # prompt of 6: block 1 holds outputs from position 6
    a.append_token(7)
    a.append_token(8)
    b = Request("b", [1, 2, 3, 4, 5], P)  # the same 8 tokens, its prompt ending at 5
    for t in (6, 7, 8):
        b.append_token(t)
    prompt = req("p", [1, 2, 3, 4, 5, 6, 7, 8])
    ha, hb, hp = bm.block_hashes(a), bm.block_hashes(b), bm.block_hashes(prompt)
    assert ha[0] == hb[0] == hp[0]  # all prompt tokens: shared
    assert len({ha[1], hb[1], hp[1]}) == 3
    assert ha[1] == hash_block(ha[0], [5, 6, 7, 8], output_marker(6))
    plain = Request("a", a.prompt_token_ids, P, all_token_ids=a.all_token_ids)
    assert BlockManager(16, 4).block_hashes(plain)[1] == hp[1]  # without the rule: one key


def test_freed_blocks_are_reused_before_never_written_ones_most_recent_first() -> None:
    """The CPU pool's pages become resident once written: a freed block without contents is taken
    again (the most recently freed first) before any block never written, with or without prefix
    caching, so a server's resident KV pages stay at what its busiest moment needed."""
    for caching in (False, True):
        bm = BlockManager(16, 2, enable_prefix_caching=caching)
        a, b = req("a", [1]), req("b", [2])  # one partial block each: never hashed
        assert bm.allocate_slots(a, 5) and bm.allocate_slots(b, 3)
        assert a.block_ids == [0, 1, 2] and b.block_ids == [3, 4]
        bm.free(a)
        bm.free(b)  # freed last: reused first
        c = req("c", [3])
        assert bm.allocate_slots(c, 12)
        assert c.block_ids == [3, 4, 0, 1, 2, 5], caching  # b's, a's, then the first never written


def test_cached_blocks_wait_behind_never_written_ones_until_the_cache_is_reset() -> None:
    """A freed block holding a cached prefix stays behind the never-written blocks (its prefix may
    be hit again); once the prefix cache is reset it holds nothing, and it is reused first."""
    bm = BlockManager(6, 2)
    a = req("a", [1, 2, 3, 4])
    admit(bm, a)
    assert a.block_ids == [0, 1] and bm.num_cached_blocks == 2
    bm.free(a)
    b = req("b", [9])
    assert bm.allocate_slots(b, 3)
    assert b.block_ids == [2, 3] and bm.num_cached_blocks == 2  # never-written blocks first
    bm.free(b)
    bm.reset_prefix_cache()
    c = req("c", [9])
    assert bm.allocate_slots(c, 8)
    assert c.block_ids == [1, 0, 2, 3] and bm.num_cached_blocks == 0  # a's written pages, then b's
