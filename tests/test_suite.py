"""The suite itself: ``make test`` shares it out among pytest-xdist workers, which know a test only by its id."""

from __future__ import annotations

from collections import Counter

import pytest


def test_every_collected_test_has_an_id_of_its_own(request: pytest.FixtureRequest) -> None:
    # Tests sharing an id are run once among them under xdist, silently (pytest 9.2 with schemathesis did this).
    counts = Counter(item.nodeid for item in request.session.items)
    assert not [nodeid for nodeid, count in counts.items() if count > 1]
