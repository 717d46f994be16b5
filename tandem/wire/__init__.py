"""Typed contracts: every value that crosses a process boundary, and one error type per failure kind.

Nothing here imports another Tandem package: the engine, the transport, the workers, the router and
the controller all speak these types.
"""
