"""The contract's generated documents: the JSON Schemas and the AsyncAPI document under
`schemas/`, and its page `docs/contract-asyncapi.md` (`make schemas`). Above the services
it describes: it reads their subscriptions."""
