"""The scope `shoal frontend` and `shoal kv-relay` follow: their membership flags (listed
namespaces, a sources file, or discovery, with endpoint prefixes), the checks of those
flags, and the namespace source and membership watch they ask for.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from shoal import membership
from shoal.cli.common import add_flag

if TYPE_CHECKING:
    from shoal.discovery import Discovery
    from shoal.frontend import FrontendConfig
    from shoal.frontend.config import MembershipFollower


def add_membership_flags(parser: argparse.ArgumentParser, what: str = "serve") -> None:
    """How the scope is chosen (one way): listed namespaces, a sources file, or discovery;
    the flags `shoal frontend` and `shoal kv-relay` share (`what`: what is done with it)."""
    add_flag(
        parser,
        "--namespace",
        action="append",
        metavar="NS",
        help=f"{what} only models of this namespace (repeatable; default: all)",
    )
    add_flag(
        parser,
        "--namespace-sources",
        type=Path,
        metavar="FILE",
        help=f'{what} the namespaces this JSON file lists ({{"version": 1, "sources": '
        '[{"namespace": "..."}]}), following its changes without a restart',
    )
    add_flag(
        parser,
        "--namespaces-from-discovery",
        action="store_true",
        help=f"{what} every namespace that has models in discovery, as namespaces come and go",
    )
    add_flag(
        parser,
        "--endpoint-prefix",
        action="append",
        metavar="P",
        help=f"with --namespace or --namespaces-from-discovery: {what} only endpoints under ns, "
        "ns.component or ns.component.endpoint in namespace ns (repeatable; with --namespace, "
        "each inside a listed namespace)",
    )


def check_membership_flags(args: argparse.Namespace) -> None:
    """One way to choose the scope; endpoint prefixes only with discovery as the source."""
    chosen = [
        flag
        for flag, given in (
            ("--namespace", bool(args.namespace)),
            ("--namespace-sources", args.namespace_sources is not None),
            ("--namespaces-from-discovery", args.namespaces_from_discovery),
        )
        if given
    ]
    if len(chosen) > 1:
        raise ValueError(f"{' and '.join(chosen)} exclude each other: choose one")
    if args.endpoint_prefix and not (args.namespaces_from_discovery or args.namespace):
        raise ValueError("--endpoint-prefix needs --namespace or --namespaces-from-discovery")
    membership_source(
        args.namespace_sources,
        args.namespaces_from_discovery,
        args.endpoint_prefix,
        namespaces=args.namespace,
    )


def membership_source(
    sources_file: Path | None,
    from_discovery: bool,
    endpoint_prefixes: list[str] | tuple[str, ...],
    *,
    namespaces: list[str] | tuple[str, ...] = (),
) -> membership.Source | None:
    """The namespace source the flags ask for (None: fixed namespaces, no prefixes); refuses
    a configuration that breaks a rule, naming it. Listed namespaces with endpoint prefixes
    are a discovery source over those namespaces."""
    if sources_file is not None:
        return membership.FileSource(sources_file)
    if from_discovery:
        return membership.DiscoverySource(watch_all=True, endpoint_prefixes=endpoint_prefixes)
    if namespaces and endpoint_prefixes:
        return membership.DiscoverySource(namespaces, endpoint_prefixes=endpoint_prefixes)
    return None


def membership_watch(
    source: membership.Source,
    endpoint_prefixes: tuple[str, ...] | list[str],
    setup_timeout: float,
) -> Callable[[Discovery], membership.MembershipWatch]:
    """A factory of the membership watch over `source` (the frontend's and the relay's)."""
    prefixes = tuple(endpoint_prefixes)

    def build(discovery: Discovery) -> membership.MembershipWatch:
        return membership.MembershipWatch(
            discovery, source, endpoint_prefixes=prefixes, setup_timeout=setup_timeout
        )

    return build


def membership_for(
    config: FrontendConfig,
) -> Callable[[Discovery], MembershipFollower] | None:
    """A factory of the membership watch the frontend's scope follows, or None."""
    source = membership_source(
        config.namespace_sources,
        config.namespaces_from_discovery,
        config.endpoint_prefixes,
        namespaces=config.namespaces,
    )
    if source is None:
        return None
    return membership_watch(source, config.endpoint_prefixes, config.setup_timeout)
