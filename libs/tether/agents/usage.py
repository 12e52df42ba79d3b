"""Token usage summed over a run, and its cost from a price table.

Cost is an estimate: it is computed from the table given to the agent, not billed by the
provider, and it is None as soon as one model turn used a model the table does not price
(a partial sum would understate the cost without saying so).
"""

from collections.abc import Iterable, Mapping

from pydantic import Field

from tether.agents.model_messages import Frozen, TokenUsage

MILLION = 1_000_000


class ModelPrice(Frozen):
    """Prices per million tokens; cached input tokens default to the input price."""

    input_per_million: float = Field(ge=0)
    output_per_million: float = Field(ge=0)
    cached_input_per_million: float | None = Field(default=None, ge=0)

    def cost(self, usage: TokenUsage) -> float:
        cached = min(usage.cached_tokens, usage.input_tokens)
        cached_price = (self.input_per_million if self.cached_input_per_million is None
                        else self.cached_input_per_million)
        return ((usage.input_tokens - cached) * self.input_per_million
                + cached * cached_price
                + usage.output_tokens * self.output_per_million) / MILLION


class PriceTable(Frozen):
    """Model name -> price. A provider-prefixed name (`openai/gpt-4o`) also matches `gpt-4o`."""

    prices: dict[str, ModelPrice] = Field(default_factory=dict)

    @classmethod
    def of(cls, prices: Mapping[str, ModelPrice | Mapping[str, float]]) -> "PriceTable":
        return cls(prices={name: ModelPrice.model_validate(price)
                           for name, price in prices.items()})

    def price_for(self, model: str | None) -> ModelPrice | None:
        if model is None:
            return None
        return self.prices.get(model) or self.prices.get(model.rsplit("/", 1)[-1])

    def cost(self, model: str | None, usage: TokenUsage) -> float | None:
        price = self.price_for(model)
        return None if price is None else price.cost(usage)


class UsageSummary(Frozen):
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    total_tokens: int = 0
    cost: float | None = None

    @classmethod
    def of(cls, turns: Iterable[tuple[TokenUsage, float | None]]) -> "UsageSummary":
        """Sum (usage, cost) pairs of model turns; cost is None if any turn's is unknown."""
        inputs = outputs = cached = 0
        cost: float | None = 0.0
        for usage, turn_cost in turns:
            inputs += usage.input_tokens
            outputs += usage.output_tokens
            cached += usage.cached_tokens
            cost = None if cost is None or turn_cost is None else cost + turn_cost
        return cls(input_tokens=inputs, output_tokens=outputs, cached_tokens=cached,
                   total_tokens=inputs + outputs,
                   cost=None if cost is None else round(cost, 10))
