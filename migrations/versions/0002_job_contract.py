"""job contract: requested settings, run measurements, one metric event per step, idempotency
fingerprints that expire

Revision ID: 0002
Revises: 0001
"""
from alembic import op
import sqlalchemy as sa


revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('requested', sa.JSON(), nullable=False, server_default='{}'))
        batch_op.add_column(sa.Column('worker_kind', sa.String(length=100), nullable=True))
        batch_op.add_column(sa.Column('run_seconds', sa.Float(), nullable=True))
    with op.batch_alter_table('job_events', schema=None) as batch_op:
        batch_op.add_column(sa.Column('step', sa.Integer(), nullable=True))
    with op.batch_alter_table('idempotency_keys', schema=None) as batch_op:
        batch_op.add_column(sa.Column('fingerprint', sa.String(length=64), nullable=False, server_default=''))
        batch_op.add_column(sa.Column('expires_at', sa.Integer(), nullable=False, server_default='0'))
        batch_op.create_index(batch_op.f('ix_idempotency_keys_expires_at'), ['expires_at'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('idempotency_keys', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_idempotency_keys_expires_at'))
        batch_op.drop_column('expires_at')
        batch_op.drop_column('fingerprint')
    with op.batch_alter_table('job_events', schema=None) as batch_op:
        batch_op.drop_column('step')
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('run_seconds')
        batch_op.drop_column('worker_kind')
        batch_op.drop_column('requested')
