"""The service's handlers of weights the worker reads and writes itself (protocol.md §22). Each is
``handler(service, session, request, frames) -> (header, frames)``, taken into
:data:`remotorch.worker.service._HANDLERS`; the work is :class:`remotorch.worker.weights.Weights`'s.
"""

from __future__ import annotations

from ..codec import messages as m
from .replies import OK, Reply


def open_weights(service, session, req: m.OpenWeights, frames) -> Reply:
    return m.encode(service.worker.weights.open(session, req.source, req.revision)), []


def load_weights(service, session, req: m.LoadWeights, frames) -> Reply:
    service.worker.weights.load(session, req)
    return OK, []


def save_weights(service, session, req: m.SaveWeights, frames) -> Reply:
    return m.encode(service.worker.weights.save(session, req, frames)), []


def save_optimizer(service, session, req: m.SaveOptimizer, frames) -> Reply:
    return m.encode(service.worker.weights.save_optimizer(session, req)), []


def load_optimizer(service, session, req: m.LoadOptimizer, frames) -> Reply:
    return m.encode(service.worker.weights.load_optimizer(session, req)), []


HANDLERS = {
    m.OpenWeights: open_weights, m.LoadWeights: load_weights, m.SaveWeights: save_weights,
    m.SaveOptimizer: save_optimizer, m.LoadOptimizer: load_optimizer,
}
