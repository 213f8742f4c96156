"""FinRL-style stock trading on the platform's own parts: the market (``market.py``), the env
(``env.py``, StockTrading-v0), the portfolio gradient (``portfolio_gradient.py``, its trainer
``portfolio_trainer.py``) and the backtest (``backtest.py``). Reference: docs/trading.md."""
