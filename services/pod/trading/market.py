"""Market data for the stock-trading env: deterministic synthetic markets in four regimes
(``synthetic_market``), a loader for users' OHLCV files (``load_csv``) and the causal indicators
the env observes. Nothing is downloaded. The regimes' generating processes, the CSV format and
the indicators' definitions: docs/trading.md, "Market data".
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, fields, replace
from pathlib import Path

import numpy as np

INDICATORS = ("macd", "rsi_30", "cci_30", "dx_30")
MOMENTUM_WINDOWS = (63, 126, 252)
CSV_COLUMNS = ("date", "tic", "open", "high", "low", "close", "volume")
TRADING_DAYS_PER_YEAR = 252
REGIMES = ("mixed", "trend", "mean_reversion", "crash")


class MarketDataError(ValueError):
    """Market data that cannot be used: missing columns, bad rows, unbalanced panel."""


@dataclass(frozen=True)
class MarketData:
    """A panel of T trading days x S stocks; every array is (T, S) except as noted."""

    dates: np.ndarray  # (T,) datetime64[D], strictly increasing
    tickers: tuple[str, ...]
    open: np.ndarray
    high: np.ndarray
    low: np.ndarray
    close: np.ndarray
    volume: np.ndarray
    indicators: np.ndarray  # (T, S, len(INDICATORS))
    turbulence: np.ndarray  # (T,) market-wide, causal (docs/trading.md)
    momentum: np.ndarray  # (T, S, len(MOMENTUM_WINDOWS)) trailing log-returns, causal

    @classmethod
    def from_ohlcv(
        cls,
        dates: np.ndarray,
        tickers: tuple[str, ...],
        open_: np.ndarray,
        high: np.ndarray,
        low: np.ndarray,
        close: np.ndarray,
        volume: np.ndarray,
    ) -> MarketData:
        """A panel with its indicators and turbulence computed (causally) from the prices."""
        return cls(
            dates=dates,
            tickers=tickers,
            open=open_,
            high=high,
            low=low,
            close=close,
            volume=volume,
            indicators=compute_indicators(high, low, close),
            turbulence=turbulence_index(close),
            momentum=trailing_log_returns(close),
        )

    @property
    def num_days(self) -> int:
        return len(self.dates)

    @property
    def num_stocks(self) -> int:
        return len(self.tickers)

    def slice(self, start: int, stop: int) -> MarketData:
        """Days ``start:stop`` (indicators keep the values computed on the full history)."""
        if not 0 <= start < stop <= self.num_days:
            raise ValueError(f"bad day range [{start}, {stop}) for {self.num_days} days")
        s = slice(start, stop)  # every field but the tickers has the days first
        days = {f.name: getattr(self, f.name)[s] for f in fields(self) if f.name != "tickers"}
        return replace(self, **days)

    def split(self, date: str | np.datetime64) -> tuple[MarketData, MarketData]:
        """(train, backtest): days before ``date`` and days from ``date`` on."""
        cut = int(np.searchsorted(self.dates, np.datetime64(date, "D")))
        if cut < 2 or cut > self.num_days - 2:
            raise ValueError(
                f"split date {date} leaves fewer than 2 days on one side "
                f"(data spans {self.dates[0]} .. {self.dates[-1]})"
            )
        return self.slice(0, cut), self.slice(cut, self.num_days)

    def default_split_date(self, train_fraction: float = 0.8) -> np.datetime64:
        return self.dates[int(self.num_days * train_fraction)]

    def split3(
        self, validation_date: str | np.datetime64, backtest_date: str | np.datetime64
    ) -> tuple[MarketData, MarketData, MarketData]:
        """(train, validation, backtest): days before ``validation_date``, from it to before
        ``backtest_date``, and from ``backtest_date`` on. Selection (which agent or snapshot
        to keep) reads the validation period only; the backtest period is for the report."""
        before, backtest = self.split(backtest_date)
        train, validation = before.split(validation_date)
        return train, validation, backtest


# -- indicators --------------------------------------------------------------------------------
def _ema(x: np.ndarray, span: int | None = None, alpha: float | None = None) -> np.ndarray:
    """Exponential moving average along axis 0, started at the first value (adjust=False)."""
    a = alpha if alpha is not None else 2.0 / (span + 1)  # type: ignore[operator]
    out = np.empty_like(x)
    out[0] = x[0]
    for t in range(1, len(x)):
        out[t] = a * x[t] + (1 - a) * out[t - 1]
    return out


def rolling_mean(x: np.ndarray, window: int) -> np.ndarray:
    """Mean over the last ``window`` days (fewer at the start), along axis 0."""
    c = np.cumsum(x, axis=0)
    out = c.copy()
    out[window:] = c[window:] - c[:-window]
    counts = np.minimum(np.arange(1, len(x) + 1), window).reshape(-1, *([1] * (x.ndim - 1)))
    return out / counts


def compute_indicators(
    high: np.ndarray, low: np.ndarray, close: np.ndarray, window: int = 30
) -> np.ndarray:
    """MACD, RSI, CCI and DX (docs/trading.md, "Indicators") as (T, S, 4)."""
    macd = _ema(close, span=12) - _ema(close, span=26)

    change = np.diff(close, axis=0, prepend=close[:1])
    gain = _ema(np.maximum(change, 0.0), alpha=1.0 / window)
    loss = _ema(np.maximum(-change, 0.0), alpha=1.0 / window)
    rsi = np.where(gain + loss > 0, 100.0 * gain / np.maximum(gain + loss, 1e-12), 50.0)

    typical = (high + low + close) / 3.0
    sma = rolling_mean(typical, window)
    # Mean absolute deviation from the current window's mean.
    mad = np.empty_like(typical)
    for t in range(min(window - 1, len(typical))):  # the first, shorter windows
        mad[t] = np.abs(typical[: t + 1] - sma[t]).mean(axis=0)
    if len(typical) >= window:
        windows = np.lib.stride_tricks.sliding_window_view(typical, window, axis=0)
        mad[window - 1 :] = np.abs(windows - sma[window - 1 :, ..., None]).mean(axis=-1)
    cci = np.where(mad > 0, (typical - sma) / (0.015 * np.maximum(mad, 1e-12)), 0.0)

    prev_close = np.concatenate([close[:1], close[:-1]])
    prev_high = np.concatenate([high[:1], high[:-1]])
    prev_low = np.concatenate([low[:1], low[:-1]])
    up, down = high - prev_high, prev_low - low
    plus_dm = np.where((up > down) & (up > 0), up, 0.0)
    minus_dm = np.where((down > up) & (down > 0), down, 0.0)
    true_range = np.maximum.reduce(
        [high - low, np.abs(high - prev_close), np.abs(low - prev_close)]
    )
    atr = _ema(true_range, alpha=1.0 / window)
    plus_di = 100.0 * _ema(plus_dm, alpha=1.0 / window) / np.maximum(atr, 1e-12)
    minus_di = 100.0 * _ema(minus_dm, alpha=1.0 / window) / np.maximum(atr, 1e-12)
    di_sum = plus_di + minus_di
    dx = np.where(di_sum > 0, 100.0 * np.abs(plus_di - minus_di) / np.maximum(di_sum, 1e-12), 0.0)
    return np.stack([macd, rsi, cci, dx], axis=-1)


def trailing_log_returns(
    close: np.ndarray, windows: tuple[int, ...] = MOMENTUM_WINDOWS
) -> np.ndarray:
    """``log(close[t] / close[max(0, t - k)])`` for each window ``k``, as (T, S, len(windows))."""
    log_close = np.log(close)
    days = np.arange(len(close))
    past = [log_close[np.maximum(days - k, 0)] for k in windows]
    return np.stack([log_close - p for p in past], axis=-1)


def turbulence_index(close: np.ndarray, window: int = TRADING_DAYS_PER_YEAR) -> np.ndarray:
    """FinRL's turbulence, causal: ``(r_t - mu)' pinv(Sigma) (r_t - mu)`` with ``mu`` and
    ``Sigma`` the mean and covariance of the daily returns of days ``t-window .. t-1``; 0 for
    the first 60 days (too little history for a covariance of several stocks)."""
    returns = np.diff(close, axis=0, prepend=close[:1]) / close
    out = np.zeros(len(close))
    for t in range(60, len(close)):
        past = returns[max(1, t - window) : t]
        deviation = returns[t] - past.mean(axis=0)
        cov = np.atleast_2d(np.cov(past, rowvar=False))
        out[t] = float(deviation @ np.linalg.pinv(cov) @ deviation)
    return out


# -- synthetic market --------------------------------------------------------------------------
def _ar1(rng: np.random.Generator, phi: float, std: float, shape: tuple[int, int]) -> np.ndarray:
    """A stationary AR(1) along axis 0 (coefficient ``phi``, stationary std ``std``)."""
    out = np.empty(shape)
    out[0] = rng.normal(0.0, std, shape[1])
    shocks = rng.normal(0.0, std * math.sqrt(1 - phi**2), shape)
    for t in range(1, shape[0]):
        out[t] = phi * out[t - 1] + shocks[t]
    return out


def _markov_sign(rng: np.random.Generator, n: int, mean_duration: float) -> np.ndarray:
    """+1/-1 states (starting +1) that flip with probability ``1/mean_duration`` a day."""
    flips = np.cumsum(rng.random(n) < 1.0 / mean_duration)
    return np.where(flips % 2 == 0, 1.0, -1.0)


def _regime_returns(
    rng: np.random.Generator, regime: str, num_days: int, num_stocks: int
) -> np.ndarray:
    """Daily log-returns (T, S) of ``regime`` (docs/trading.md, "Synthetic markets")."""
    t, s = num_days, num_stocks
    if regime == "mixed":  # its own order of draws: the other regimes came later
        drift = _ar1(rng, 0.995, 0.0015, (t, s))
        bull_bear = _markov_sign(rng, t, 120.0) * 0.0005
        beta = rng.uniform(0.6, 1.4, s)
        market = rng.normal(0.0, 0.01, t)
        return bull_bear[:, None] + drift + beta * market[:, None] + rng.normal(0.0, 0.01, (t, s))
    beta = rng.uniform(0.7, 1.3, s)
    if regime == "trend":
        bull = _markov_sign(rng, t, 250.0)
        market_drift = np.where(bull > 0, 0.0006, -0.0005)
        drift = _ar1(rng, 0.998, 0.0010, (t, s))
        market = market_drift + rng.normal(0.0, 0.009, t)
        return drift + beta * market[:, None] + rng.normal(0.0, 0.012, (t, s))
    if regime == "mean_reversion":
        # log price = fundamental (random walk with drift, market-driven) + AR(1) deviation.
        market = 0.0003 + rng.normal(0.0, 0.006, t)
        fundamental = beta * market[:, None] + rng.normal(0.0, 0.004, (t, s))
        deviation = _ar1(rng, 0.95, 0.06, (t, s))
        return fundamental + np.diff(deviation, axis=0, prepend=deviation[:1])
    if regime == "crash":
        vol = np.full(t, 0.008)
        market_drift = np.full(t, 0.0007)
        day = 0
        while day < t:
            day += int(rng.geometric(1.0 / 400.0))  # ~ one crash every 400+ trading days
            stress, crash = int(rng.integers(15, 31)), int(rng.integers(5, 11))
            stress_end = min(day + stress, t)
            vol[day:stress_end] = 0.025  # the warning: volatility and correlation rise
            market_drift[day:stress_end] = -0.002
            crash_end = min(stress_end + crash, t)
            market_drift[stress_end:crash_end] = rng.uniform(-0.03, -0.015)
            vol[stress_end:crash_end] = 0.03
            day = crash_end + 40  # the recovery: no new crash for two months
        market = market_drift + vol * rng.normal(0.0, 1.0, t)
        return beta * market[:, None] + rng.normal(0.0, 0.009, (t, s))
    raise ValueError(f"unknown regime {regime!r}; one of {', '.join(REGIMES)}")


def synthetic_market(
    seed: int = 0,
    num_stocks: int = 5,
    num_days: int = 2520,
    start: str = "2010-01-04",
    regime: str = "mixed",
    replica: int | None = None,
) -> MarketData:
    """A deterministic market: same arguments, same data, on every machine. ``replica`` = k >= 0
    is another market of the same regime and shape, from a stream of its own (no market seed's
    market). The regimes' processes: docs/trading.md, "Synthetic markets"."""
    if num_stocks < 1 or num_days < 60:
        raise ValueError("synthetic_market needs num_stocks >= 1 and num_days >= 60")
    if regime not in REGIMES:
        raise ValueError(f"unknown regime {regime!r}; one of {', '.join(REGIMES)}")
    if replica is not None and replica < 0:
        raise ValueError(f"replica must be >= 0, got {replica}")
    # A stream of its own per regime and per replica: adding either changed no earlier data.
    entropy = [seed, 0x5EED]
    if regime != "mixed" or replica is not None:
        entropy.append(REGIMES.index(regime))
    if replica is not None:
        entropy += [0x5E9, replica]
    rng = np.random.default_rng(np.random.SeedSequence(entropy))
    log_ret = _regime_returns(rng, regime, num_days, num_stocks)
    return _ohlcv(rng, log_ret, num_stocks, num_days, start)


def _ohlcv(
    rng: np.random.Generator, log_ret: np.ndarray, num_stocks: int, num_days: int, start: str
) -> MarketData:
    """Prices, volumes and indicators from daily close-to-close log-returns (T, S)."""
    log_ret[0] = 0.0
    start_price = rng.uniform(20.0, 200.0, num_stocks)
    close = start_price * np.exp(np.cumsum(log_ret, axis=0))
    gap = rng.normal(0.0, 0.003, (num_days, num_stocks))
    open_ = np.concatenate([start_price[None], close[:-1]]) * np.exp(gap)
    wick = np.abs(rng.normal(0.0, 0.006, (2, num_days, num_stocks)))
    high = np.maximum(open_, close) * np.exp(wick[0])
    low = np.minimum(open_, close) * np.exp(-wick[1])
    volume = np.round(1e6 * np.exp(rng.normal(0.0, 0.3, (num_days, num_stocks)))) * (
        1.0 + 20.0 * np.abs(log_ret)
    )
    dates = np.busday_offset(np.datetime64(start, "D"), np.arange(num_days), roll="forward")
    tickers = tuple(f"SYN{i}" for i in range(num_stocks))
    return MarketData.from_ohlcv(dates, tickers, open_, high, low, close, np.round(volume))


# -- CSV loader --------------------------------------------------------------------------------
def load_csv(path: str | Path) -> MarketData:
    """Read OHLCV rows (columns: docs/trading.md, "Your own data") into a ``MarketData``; a
    ``MarketDataError`` names missing columns, or the line and the problem of a bad row."""
    path = Path(path)
    try:
        handle = path.open(newline="", encoding="utf-8")
    except OSError as exc:
        raise MarketDataError(f"cannot read market data file {path}: {exc.strerror}") from exc
    with handle:
        reader = csv.DictReader(handle)
        header = [h.strip() for h in reader.fieldnames or []]
        if missing := [c for c in CSV_COLUMNS if c not in header]:
            raise MarketDataError(
                f"{path}: missing column(s) {', '.join(missing)}; expected "
                f"{', '.join(CSV_COLUMNS)} (found {', '.join(header) or 'no header'})"
            )
        reader.fieldnames = header
        rows: dict[tuple[np.datetime64, str], tuple[float, ...]] = {}
        for line, row in enumerate(reader, start=2):
            rows_key, values = _parse_row(path, line, row)
            if rows_key in rows:
                raise MarketDataError(
                    f"{path}:{line}: duplicate row for date {rows_key[0]} tic {rows_key[1]}"
                )
            rows[rows_key] = values
    if not rows:
        raise MarketDataError(f"{path}: no data rows")
    dates = np.array(sorted({d for d, _ in rows}), dtype="datetime64[D]")
    tickers = tuple(sorted({t for _, t in rows}))
    for d in dates:
        if absent := [t for t in tickers if (d, t) not in rows]:
            raise MarketDataError(
                f"{path}: date {d} has no row for tic {', '.join(absent)} (every date must "
                "list every ticker)"
            )
    if len(dates) < 2:
        raise MarketDataError(f"{path}: need at least 2 trading days, found {len(dates)}")
    table = np.array([[rows[(d, t)] for t in tickers] for d in dates])  # (T, S, 5)
    open_, high, low, close, volume = np.moveaxis(table, -1, 0)
    return MarketData.from_ohlcv(dates, tickers, open_, high, low, close, volume)


def _parse_row(
    path: Path, line: int, row: dict[str, str | None]
) -> tuple[tuple[np.datetime64, str], tuple[float, ...]]:
    where = f"{path}:{line}"
    if empty := [c for c in CSV_COLUMNS if not (row.get(c) or "").strip()]:
        raise MarketDataError(f"{where}: empty value in column(s) {', '.join(empty)}")
    try:
        date = np.datetime64((row["date"] or "").strip(), "D")
    except ValueError as exc:
        raise MarketDataError(f"{where}: date {row['date']!r} is not YYYY-MM-DD") from exc
    values = []
    for column in ("open", "high", "low", "close", "volume"):
        text = (row[column] or "").strip()
        try:
            value = float(text)
        except ValueError as exc:
            raise MarketDataError(f"{where}: {column} {text!r} is not a number") from exc
        if not math.isfinite(value):
            raise MarketDataError(f"{where}: {column} is not finite ({text})")
        values.append(value)
    open_, high, low, close, volume = values
    if min(open_, low, close) <= 0:
        raise MarketDataError(f"{where}: prices must be > 0 (open, low and close)")
    if volume < 0:
        raise MarketDataError(f"{where}: volume must be >= 0, got {volume}")
    if high < max(open_, close, low) or low > min(open_, close):
        raise MarketDataError(f"{where}: high/low do not bracket open and close")
    return (date, (row["tic"] or "").strip()), tuple(values)
