"""uvicorn's HTTP protocols (h11 or httptools) with two defences that must run before any
ASGI work: a deadline for each request head, and a per-address rate on WebSocket upgrades
that carry no key.

Each connection costs the event loop an accept, a parse and, for a WebSocket, a handshake
and a close before the app's own caps can refuse it. A burst of a thousand keyless
sockets from one address therefore stalled every stream for about a second. Here an
upgrade without a valid key in its Authorization header, over its address's rate or
from an address that already holds its share of sockets still authenticating, is
answered with a static 429 and closed from inside `data_received`: no ASGI task, no
WebSocket protocol, no handshake (docs/PROTOCOL.md, "Limits").
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Callable

from uvicorn.protocols.http.h11_impl import H11Protocol

from .limits import AddressRate

# The scope key under which the app finds its connection's transport, to abort it when a
# write passes its deadline (gateway/sse.py `deadline_send`, gateway/ws_socket.py).
TRANSPORT_KEY = "streamgate.transport"


def abort_transport(scope) -> bool:
    """Drop the connection now, its unsent buffer too (`close()` would wait for a reader
    that never comes); False if the scope carries no transport (another server)."""
    transport = scope.get(TRANSPORT_KEY)
    if transport is None:
        return False
    transport.abort()
    return True


def _too_many_upgrades(message: str = "too many WebSocket connections without a key from this address; "
                                      "send 'Authorization: Bearer <key>' or retry later") -> bytes:
    body = json.dumps({"error": {"message": message,
                                 "type": "rate_limit_error", "param": None, "code": "too_many_connections"}})
    return (f"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"retry-after: 1\r\nconnection: close\r\n\r\n{body}").encode()


TOO_MANY_UPGRADES = _too_many_upgrades()
TOO_MANY_CONNECTIONS = _too_many_upgrades("too many open connections from this address; close some or retry later")
TOO_MANY_KEYED_UPGRADES = _too_many_upgrades(
    "too many WebSocket connections for this key: its tenant's sockets are all open or it is "
    "opening them too fast; close one or retry later")


class Defended:
    """Mixed into uvicorn's H11Protocol or HttpToolsProtocol (both keep `cycle`, `headers`
    and `client`). `header_timeout`: uvicorn times out an idle keep-alive connection but
    not one that opens and never sends, or sends its head a byte at a time; such a
    connection is closed `header_timeout` seconds after it opened (or after the first byte
    of its next request). `keyless_upgrades`: the shared per-address rate (None: off);
    `address_full(address)`: whether the address already holds its share of sockets
    still authenticating (the gateway's count; None: not checked here);
    `known_key(authorization)`: the tenant whose valid key an Authorization header
    carries, or None, so that a made-up header does not buy a full handshake (None: any
    header counts); for a valid key, `tenant_full(tenant)` (its socket places are all
    taken) and `keyed_upgrades` (a rate per tenant) refuse the upgrade with a 429 too."""

    header_timeout = 10.0
    keyless_upgrades: AddressRate | None = None
    address_full: Callable[[str], bool] | None = None
    known_key: Callable[[bytes], str | None] | None = None
    keyed_upgrades: AddressRate | None = None
    tenant_full: Callable[[str], bool] | None = None
    max_per_address = 0                 # open HTTP connections from one address (0: no cap)
    per_address: Counter | None = None  # shared by every connection of one server
    _header_timer: asyncio.TimerHandle | None = None
    _counted: str | None = None

    @property
    def scope(self):
        return self.__dict__.get("_scope")

    @scope.setter
    def scope(self, value) -> None:
        """Every request scope the protocol builds carries its transport (TRANSPORT_KEY)."""
        if isinstance(value, dict) and getattr(self, "transport", None) is not None:
            value[TRANSPORT_KEY] = self.transport
        self.__dict__["_scope"] = value

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if self.max_per_address and self.per_address is not None:
            address = self.client[0] if self.client else ""
            self._counted = address
            self.per_address[address] += 1
            if self.per_address[address] > self.max_per_address:
                transport.write(TOO_MANY_CONNECTIONS)
                transport.close()
                return
        self._arm()

    def _uncount(self) -> None:
        """Give back this connection's place under its address (closed, or now a WebSocket,
        which the gateway's own socket pools count)."""
        address, self._counted = self._counted, None
        if address is not None:
            self.per_address[address] -= 1
            if self.per_address[address] <= 0:
                del self.per_address[address]

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None and (self.cycle is None or self.cycle.response_complete):
            self._arm()                 # the first bytes of a next request on a kept-alive connection
        cycle = self.cycle
        super().data_received(data)
        if self.cycle is not cycle:     # a complete request head arrived
            self._disarm()

    def handle_websocket_upgrade(self, *event) -> None:
        self._disarm()                  # the transport now belongs to the WebSocket protocol (or is closed)
        authorization = next((value for name, value in self.headers if name == b"authorization"), None)
        tenant = None if authorization is None or self.known_key is None else self.known_key(authorization)
        keyed = authorization is not None and (self.known_key is None or tenant is not None)
        if tenant is not None:
            # A valid key buys a handshake only while its tenant has a socket place left and
            # opens sockets at a bounded rate (the app's own cap would refuse only after it).
            if (self.tenant_full is not None and self.tenant_full(tenant)) or \
                    (self.keyed_upgrades is not None and not self.keyed_upgrades.admit(tenant)):
                self.transport.write(TOO_MANY_KEYED_UPGRADES)
                self.transport.close()
                return
        if not keyed:
            address = self.client[0] if self.client else ""
            if (self.address_full is not None and self.address_full(address)) or \
                    (self.keyless_upgrades is not None and not self.keyless_upgrades.admit(address)):
                self.transport.write(TOO_MANY_UPGRADES)
                self.transport.close()
                return
        super().handle_websocket_upgrade(*event)
        self._uncount()
        upgraded = self.transport.get_protocol()
        if isinstance(getattr(upgraded, "scope", None), dict):     # its task has not run yet
            upgraded.scope[TRANSPORT_KEY] = self.transport

    def connection_lost(self, exc) -> None:
        self._disarm()
        self._uncount()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout, self._expire)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _expire(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()


def _httptools_protocol() -> type | None:
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:                 # httptools is not installed
        return None
    return HttpToolsProtocol


def protocol_class(http: str, *, header_timeout: float, keyless_rate: float, keyless_burst: int,
                   address_full: Callable[[str], bool] | None = None,
                   known_key: Callable[[bytes], str | None] | None = None, keyed_rate: float = 0.0,
                   keyed_burst: int = 0, tenant_full: Callable[[str], bool] | None = None,
                   max_per_address: int = 0, clock=time.monotonic) -> type:
    """The protocol class uvicorn instantiates per connection. `http`: "h11", "httptools"
    or "auto" (httptools where it is installed, as uvicorn chooses). `keyless_rate` (per
    second) and `keyless_burst`: WebSocket upgrades without a key per client address;
    a rate of 0 turns the limit off. `address_full`, `known_key`: see `Defended`."""
    base = H11Protocol
    if http in ("auto", "httptools"):
        base = _httptools_protocol() or base
        if http == "httptools" and base is H11Protocol:
            raise ValueError("--http httptools: the httptools package is not installed")
    elif http != "h11":
        raise ValueError(f"--http: unknown {http!r} (auto, h11, httptools)")
    gate = AddressRate(keyless_rate, keyless_burst, clock=clock) if keyless_rate > 0 else None
    keyed = AddressRate(keyed_rate, keyed_burst, clock=clock) if keyed_rate > 0 else None
    return type(f"Defended{base.__name__}", (Defended, base),
                {"header_timeout": header_timeout, "keyless_upgrades": gate,
                 "address_full": None if address_full is None else staticmethod(address_full),
                 "known_key": None if known_key is None else staticmethod(known_key), "keyed_upgrades": keyed,
                 "tenant_full": None if tenant_full is None else staticmethod(tenant_full),
                 "max_per_address": max_per_address, "per_address": Counter()})
