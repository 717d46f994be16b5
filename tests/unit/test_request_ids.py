"""Request ids (router/request_ids.py): a caller's duplicate is refused, another caller's is not, and
the cluster's ids never collide across routers."""

import pytest

from tandem.router.request_ids import ActiveRequests, DuplicateRequest


def test_a_live_id_is_refused_to_its_caller_only_and_freed_at_release():
    ids = ActiveRequests("router-a")
    first = ids.claim("peer:1", "r")
    with pytest.raises(DuplicateRequest, match="'r'"):
        ids.claim("peer:1", "r")
    other = ids.claim("peer:2", "r")
    assert first != other and first.startswith("r@router-a.")
    ids.release("peer:1", "r")
    assert ids.claim("peer:1", "r") not in (first, other)
    assert len(ids) == 2


def test_two_routers_never_give_the_same_cluster_id():
    a, b = ActiveRequests("router-a"), ActiveRequests("router-b")
    assert a.claim("c", "r") != b.claim("c", "r")
