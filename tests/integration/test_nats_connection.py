"""`connect_nats` on any nats-py: the services' fast client only where the installed release
is one it was tested with, nats-py's own client elsewhere."""

from nats.aio.client import Client as NATS

from tether.adapters import nats_connection
from tether.adapters.nats_connection import connect_nats
from tether.adapters.nats_fastpath import FastClient


async def test_an_untested_nats_py_gets_its_own_client_even_when_the_fast_path_is_asked_for(
        settings, monkeypatch):
    # What `nats_fastpath.supported()` answers on a release outside its TESTED.
    monkeypatch.setattr(nats_connection, "fastpath_supported", lambda: False)
    nc = await connect_nats(settings.nats_url, name="untested", fast_path=True)
    try:
        assert type(nc) is NATS and not isinstance(nc, FastClient)
        await nc.publish("untested.ping", b"")
        await nc.flush()
    finally:
        await nc.drain()
