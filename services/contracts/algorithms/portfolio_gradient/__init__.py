"""The portfolio gradient's card: FinRL's policy gradient, the exact gradient of a trading
account's Sharpe ratio through the market's closes, which only StockTrading-v0 has."""

from services.contracts.algorithms.card import AlgorithmCard, PopulationCard
from services.contracts.algorithms.portfolio_gradient.config import PortfolioGradientConfig

#: Its own family: its trainer differentiates through the env (services/pod/trading/).
PORTFOLIO_GRADIENT = "portfolio_gradient"

#: A population pod's agents share the market; each has its own step size and penalty.
POPULATION = PopulationCard(hyperparameters=("learning_rate", "l2"))

CARD = AlgorithmCard(
    name="portfolio_gradient",
    family=PORTFOLIO_GRADIENT,
    config=PortfolioGradientConfig,
    action_kinds=("continuous",),
    envs=("StockTrading-v0",),
    population=POPULATION,
    presets_package=__name__,
    summary="FinRL's portfolio policy gradient (StockTrading-v0 only)",
)
