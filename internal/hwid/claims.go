// Package hwid owns hardware claims: their validation and normalization, the
// placeholder rules, the hardware key derived from them, and the matching of a
// join token's expect binding against them. JoinService and the inventory
// side both derive hardware keys here and nowhere else.
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
