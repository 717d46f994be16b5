"""Cluster subcommands of `tandem` (up, chat, status, ...). Registered into the CLI's parser."""

from __future__ import annotations


def register(sub) -> None:
    pass
