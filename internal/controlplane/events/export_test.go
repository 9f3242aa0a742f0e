package events

// HubWaiting is the number of tenants whose readers the hub keeps a
// channel for.
func HubWaiting(h *Hub) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return len(h.tenants)
}
