"""FinRL-style stock trading on the platform's own parts: the market (``market.py``), the env
(``env.py``, StockTrading-v0), the portfolio gradient (``portfolio_gradient.py``, its trainer
``portfolio_trainer.py``), the backtest (``backtest.py``) and the in-process tournaments
(``tournament.py`` on ``local_tournament.py``'s round loop). Reference: docs/trading.md."""
