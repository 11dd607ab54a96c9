"""``python -m bench.step_costs``: the older spelling of ``python -m builder.step_costs`` (the step-cost measurement
``make build-engines`` runs lives in builder/ now; dated reports in docs/benchmarks/ name this one)."""

from __future__ import annotations

import sys

from builder.step_costs import main

if __name__ == "__main__":
    sys.exit(main())
