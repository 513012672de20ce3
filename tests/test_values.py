"""The checks every writer of values runs before anything is sent (``ecrec.tables.values``): a refusal names
the rows at fault, not the range checked.  In-process."""

from __future__ import annotations

import numpy as np
import pytest

from ecrec.tables.spec import TableSpec
from ecrec.tables.values import check_values


def test_a_refusal_names_the_rows_at_fault():
    spec = TableSpec("ada", 2000, 4, optimizer="adagrad", lr=0.1)
    weights = np.ones((2000, 4), np.float32)
    weights[5, 2] = np.nan
    with pytest.raises(ValueError, match=r"table 'ada': weights must be finite float32 numbers \(row 5 is not\)"):
        check_values(spec, weights)
    weights[[7, 1500, 1999, 1998], 0] = np.inf
    with pytest.raises(ValueError, match=r"\(rows 5, 7, 1500, \.\.\. \(5 rows\) are not\)"):
        check_values(spec, weights)
    state = np.ones((2000, 4), np.float32)
    state[[3, 11]] = -1.0
    with pytest.raises(ValueError, match=r"an Adagrad accumulator is negative \(rows 3, 11\)"):
        check_values(spec, state, "state")
    payload = np.ones((2000, 8), np.float32)
    payload[9, 1] = -1.0  # a weight may be negative; an accumulator may not
    check_values(spec, payload, "payload")
    payload[9, 6] = -1.0
    with pytest.raises(ValueError, match=r"negative \(row 9\)"):
        check_values(spec, payload, "payload")
    with pytest.raises(ValueError, match=r"\(row 70000 is not\)"):  # past the first piece checked
        big = np.ones((70001, 4), np.float32)
        big[70000, 3] = np.nan
        check_values(TableSpec("big", 70001, 4, optimizer="sgd", lr=0.1), big)
