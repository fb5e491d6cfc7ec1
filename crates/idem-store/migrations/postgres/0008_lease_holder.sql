-- The lease holder identity (etcd/Kubernetes term) a trigger named, within the principal in
-- lease_owner: a trigger of the same principal and holder during a valid lease gets its own
-- grant back (a resent acquire whose reply was lost). NULL for anonymous triggers and for
-- connector operations, whose lease is idem's executor's.
ALTER TABLE operations ADD COLUMN lease_holder TEXT;
