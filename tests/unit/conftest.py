"""Fixtures shared by the unit tests."""

import pytest

from tests.unit.kv_factories import open_pair


@pytest.fixture
def pair():
    """A sender and a receiver joined by the fake network (kv_factories.open_pair), closed after."""
    opened = open_pair()
    yield opened
    opened[0].close()
    opened[1].close()
