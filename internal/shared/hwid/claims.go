// Package hwid owns hardware claims: their validation and normalization, the
// placeholder rules, the hardware key derived from them, and the matching of a
// join token's expect binding against them. JoinService and the inventory
// side both derive hardware keys here and nowhere else. Anyone may import it;
// it imports nothing of the product but errs.
//
// # The matching rule: which machine is this?
//
// A machine is found again (a reclaim, R6.3) when its hardware key equals a
// node's. Placeholder values (To Be Filled By O.E.M., all-zero UUIDs, one
// repeated character, ...) are dropped first and never count (R6.1), and a
// key is trusted only with at least two independent kinds of identifier
// left: the product UUID, a serial, the permanent MACs, the GPU UUIDs (each
// kind counted once).
//
// The product UUID and the serials are the stable identifiers; MACs and GPU
// UUIDs name replaceable parts. When a product UUID and a serial are both
// left, the key is derived from them alone, so a replaced, added or removed
// NIC or GPU does not make the machine a new node. Otherwise the key is
// derived from every identifier left, and the MACs and GPU UUIDs count only
// to reach the two-kind threshold: one stable identifier alone is too weak a
// name (cloned VMs share product UUIDs, vendors reuse serials), so such a
// machine is named by its parts too, and a part swap makes it a new machine.
// See HardwareKey and Normalized.Key.
//
// SECURITY: claims are what a machine says, never proof. A key decides which
// node a join lands on only for a join the token already admitted; it grants
// nothing by itself (a reclaim needs an allowReclaim token, R6.3).
package hwid

// Claims are what a machine says about its hardware, as bcd collects them
// from sysfs. They are not trusted: they only bind tokens (expect) and find
// the node a reinstalled machine already is (reclaim).
type Claims struct {
	ProductUUID   string   `json:"productUuid,omitempty"`
	ProductSerial string   `json:"productSerial,omitempty"`
	BoardSerial   string   `json:"boardSerial,omitempty"`
	ChassisSerial string   `json:"chassisSerial,omitempty"`
	MACs          []string `json:"macs,omitempty"`     // permanent MACs of physical NICs
	GPUUUIDs      []string `json:"gpuUuids,omitempty"` // e.g. GPU-8f0c…
	Hostname      string   `json:"hostname,omitempty"`
}

// Expect pins a join token to one machine: every non-empty field must be
// among the machine's claims.
type Expect struct {
	ProductUUID string `json:"productUuid,omitempty"`
	Serial      string `json:"serial,omitempty"`
	MAC         string `json:"mac,omitempty"`
	GPUUUID     string `json:"gpuUuid,omitempty"`
}

// Empty reports whether e binds nothing.
func (e Expect) Empty() bool {
	return e.ProductUUID == "" && e.Serial == "" && e.MAC == "" && e.GPUUUID == ""
}
