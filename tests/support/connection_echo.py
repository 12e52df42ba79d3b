"""An ASGI app that answers each request with the port its connection came from: one port
over many requests means one connection served them all."""


async def app(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": str(scope["client"][1]).encode()})
