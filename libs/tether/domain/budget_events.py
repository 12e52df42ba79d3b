"""The events of budgets in tokens and cost over a tree, appended to a budgeted run for
each run below it: its reserved share (`run.budget_reserved`), its model usage step by
step (`run.usage_charged`), and its end (`run.budget_released`). The decisions that
append them are `tether.domain.spending`. Exported by `tether.domain.events` too."""

from typing import Literal

from tether.domain.event_envelope import EventEnvelope, Money, NonNegative, RunRef, tag_types
from tether.domain.records import Record


class RunBudgetReservedData(Record, frozen=True, kw_only=True):
    """A run below this one (`run`) reserved a share of this run's token or cost budget
    as it was requested: its own budget, or its agent type's estimate. `owner`: the
    request that claims it, its command's `cmd:<seq>` (a redelivery of the command keeps
    it): the one that reserved it, or one for the same run id that found it held and
    joined (then `tokens` and `cost` repeat the share's). None: the share is the run's
    own, claimed by no request (held again for a run that exists, or reserved by a
    version before 2), and no request withdraws it."""

    run: RunRef
    tokens: NonNegative = 0
    cost: Money = 0.0
    owner: str | None = None


class RunUsageChargedData(Record, frozen=True, kw_only=True):
    """The model usage of step `step` of a run below this one (`run`), counted against
    this run's budget."""

    run: RunRef
    step: NonNegative
    tokens: NonNegative = 0
    cost: Money = 0.0


class RunBudgetReleasedData(Record, frozen=True, kw_only=True):
    """A run below this one (`run`) ended: what it reserved and has not used is free.
    `owner`: a request refused by a budget further up withdrew its claim on the share
    (`RunBudgetReservedData.owner`): the share is free once no request claims it. None:
    the run ended, the share is free whoever claimed it."""

    run: RunRef
    owner: str | None = None


class RunBudgetReserved(EventEnvelope, frozen=True, kw_only=True, tag="run.budget_reserved"):
    schema_version: Literal[2] = 2
    data: RunBudgetReservedData


class RunUsageCharged(EventEnvelope, frozen=True, kw_only=True, tag="run.usage_charged"):
    schema_version: Literal[1] = 1
    data: RunUsageChargedData


class RunBudgetReleased(EventEnvelope, frozen=True, kw_only=True, tag="run.budget_released"):
    schema_version: Literal[2] = 2
    data: RunBudgetReleasedData


tag_types(RunBudgetReserved, RunUsageCharged, RunBudgetReleased)
