"""The application's models: its own tables, and fencing's tables in the same ``MetaData``.

Alembic sees all of them (``migrations/env.py``: ``target_metadata = Base.metadata``), so
``alembic revision --autogenerate`` writes the library's tables into the application's own
migrations, as any other table; ``migrations/versions/0001_initial.py`` is what it wrote,
and ``0002_ready_index_in_claim_order.py`` what it wrote when fencing changed its index.
"""

from __future__ import annotations

from sqlalchemy import BigInteger, ForeignKey, Integer, String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

import fencing


class Base(DeclarativeBase):
    pass


#: the library's tables, in the application's MetaData (stock SQLAlchemy column types only,
#: so the generated migration needs no import of fencing)
jobs = fencing.jobs_table(Base.metadata)
fence_marks = fencing.fence_marks_table(Base.metadata)
idempotency_keys = fencing.idempotency_keys_table(Base.metadata)


class Order(Base):
    """What the application sells; each order is billed by one job."""

    __tablename__ = "orders"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    customer: Mapped[str] = mapped_column(String(100))
    quantity: Mapped[int] = mapped_column(Integer)
    unit_price: Mapped[int] = mapped_column(Integer)


class Invoice(Base):
    """The job's result, written by the worker holding the job's lease, in the same
    transaction as the job's completion (``store.fenced(lease, conn=session)``)."""

    __tablename__ = "invoices"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    order_id: Mapped[int] = mapped_column(ForeignKey("orders.id"), unique=True)
    total: Mapped[int] = mapped_column(Integer)
    worker: Mapped[str] = mapped_column(String(100))
    #: the fence of the lease the invoice was written under (for the report)
    fence: Mapped[int] = mapped_column(BigInteger)
