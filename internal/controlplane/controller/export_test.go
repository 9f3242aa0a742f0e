package controller

import (
	"context"

	"github.com/better-compute/better-compute/internal/controlplane/store"
)

// Claim claims a batch the way RunOnce does and processes nothing: what a
// replica killed right after its claim leaves behind.
func (c *Controller) Claim(ctx context.Context) ([]store.WorkItem, error) { return c.claim(ctx) }
