"""The leaf runtime every Tandem process shares: logging setup, the metrics registry, process setup
(GIL switch interval, gc monitor) and small timing helpers. It imports no other Tandem package but
tandem.wire."""
