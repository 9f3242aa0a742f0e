package store

import (
	"context"
	"fmt"
	"time"
)

// PendingJoinRequests counts, up to limit, the pending join requests of a
// pool (source "") or of a source across every pool (poolID ""): what
// JoinService bounds before an unauthenticated caller may add one (R15.4).
// The count stops at limit, so a full pool costs the same as a nearly
// empty one.
func (t *Tx) PendingJoinRequests(ctx context.Context, tenantID, poolID, source string, limit int) (int, error) {
	q, args := `SELECT COUNT(*) FROM (SELECT 1 FROM join_requests WHERE tenant_id = ? AND pool_id = ? AND state = 'pending' LIMIT ?) AS p`, []any{tenantID, poolID, limit}
	if poolID == "" {
		q, args = `SELECT COUNT(*) FROM (SELECT 1 FROM join_requests WHERE source = ? AND state = 'pending' LIMIT ?) AS p`, []any{source, limit}
	}
	var n int
	if err := t.queryRow(ctx, q, args...).Scan(&n); err != nil {
		return 0, fmt.Errorf("count pending join requests: %w", err)
	}
	return n, nil
}

// JoinRequestRefreshedWithin says whether the request was created or last
// refreshed less than d ago, by compute_now().
func (t *Tx) JoinRequestRefreshedWithin(ctx context.Context, id string, d time.Duration) (bool, error) {
	var recent bool
	err := t.queryRow(ctx, `SELECT updated_ms > compute_now() - ? FROM join_requests WHERE id = ?`, d.Milliseconds(), id).Scan(&recent)
	if err != nil {
		return false, fmt.Errorf("read join request %s: %w", id, err)
	}
	return recent, nil
}
