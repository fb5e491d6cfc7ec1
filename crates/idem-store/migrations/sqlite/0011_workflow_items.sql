-- Steps for each item of a list (issue 34). One row per item, written once when its step
-- is reached and its list read: the item's identity (the value of the step's
-- `for_each.id` field, never its position), its place in the list, and the keys of its
-- operation (`{instance}:{step}:{item}`) and of its compensation's. As for
-- `workflow_steps`, an item's state is its operation's, read through a join.
CREATE TABLE workflow_items (
    tenant      TEXT   NOT NULL,
    instance_id TEXT   NOT NULL,
    position    BIGINT NOT NULL,
    item        TEXT   NOT NULL,
    seq         BIGINT NOT NULL,
    step        TEXT   NOT NULL,
    op_key      TEXT   NOT NULL,
    comp_key    TEXT   NOT NULL,
    policy      TEXT   NOT NULL CHECK (policy = 'redo_safe' OR policy = 'lookup_before_redo' OR policy = 'compensate' OR policy = 'manual'),
    PRIMARY KEY (tenant, instance_id, position, item)
);
-- An operation belongs to at most one item (the checkpoints join, the reconciler and the
-- sweeper ask by key).
CREATE UNIQUE INDEX workflow_items_by_op ON workflow_items (tenant, op_key);
CREATE UNIQUE INDEX workflow_items_by_comp ON workflow_items (tenant, comp_key);
