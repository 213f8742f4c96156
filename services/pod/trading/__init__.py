"""FinRL-style stock trading on the platform's own parts: the market (``market.py``), the env
(``env.py``, registered as StockTrading-v0), the portfolio gradient (``portfolio_gradient.py``,
its trainer ``portfolio_trainer.py``), the held-out backtest (``backtest.py``) and the
in-process tournaments the benches run (``tournament.py``), both on one round loop with the
leaderboard's PBT decision (``local_tournament.py``)."""
