from ec_daemon.core.eviction import LRUPolicy


def test_chooses_least_recently_used_first():
    lru = LRUPolicy()
    for key in "abcd":
        lru.add(key, 1)
    lru.touch("a")
    assert lru.choose(2) == ["b", "c"]


def test_choose_covers_the_requested_pages():
    lru = LRUPolicy()
    lru.add("big", 8)
    lru.add("small", 1)
    assert lru.choose(3) == ["big"]
    assert lru.choose(9) == ["big", "small"]


def test_choose_is_all_or_nothing():
    lru = LRUPolicy()
    lru.add("a", 2)
    assert lru.choose(3) == []
    assert lru.evictable_pages == 2


def test_removed_keys_are_never_chosen():
    lru = LRUPolicy()
    lru.add("a", 1)
    lru.add("b", 1)
    lru.remove("a")
    lru.remove("missing")
    assert lru.choose(1) == ["b"]
    assert lru.evictable_pages == 1 and len(lru) == 1


def test_re_adding_counts_as_a_use():
    lru = LRUPolicy()
    lru.add("a", 1)
    lru.add("b", 1)
    lru.add("a", 1)
    assert lru.choose(1) == ["b"]
    assert lru.evictable_pages == 2
