package hwid

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"testing"
)

// R6.1: placeholder values firmware reports instead of identifiers.
func TestIsPlaceholder(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want bool
	}{
		{"To Be Filled By O.E.M.", true},
		{"to be filled by o.e.m.", true},
		{"TO BE FILLED BY OEM", true},
		{"Default string", true},
		{"DEFAULT STRING", true},
		{"System Serial Number", true},
		{"Chassis Serial Number", true},
		{"Base Board Serial Number", true},
		{"System Product Name", true},
		{"Type1ProductConfigId", true},
		{"Not Specified", true},
		{"Not Applicable", true},
		{"None", true},
		{"N/A", true},
		{"n/a", true},
		{"OEM", true},
		{"Unknown", true},
		{"0", true},
		{"0123456789", true},
		{"123456789", true},
		{" Default string ", true},
		{"", true},
		{"   ", true},
		{"---", true},
		{"00000000", true},
		{"XXXXXXXX", true},
		{"xXxX-xx", true},
		{"FF:FF:FF:FF:FF:FF", true},
		{"11:11:11:11:11:11", true},
		{"00000000-0000-0000-0000-000000000000", true},
		{"FFFFFFFF-FFFF-FFFF-FFFF-FFFFFFFFFFFF", true},
		{"ffffffffffffffffffffffffffffffff", true},
		{"03000200-0400-0500-0006-000700080009", true},
		{"03000200040005000006000700080009", true},
		{"00020003-0004-0005-0006-000700080009", true},
		{"CZ2345ABCD", false},
		{"PF2ABCDE", false},
		{"4c4c4544-0042-3510-8052-b4c04f4e3732", false},
		{"3c:ec:ef:01:02:03", false},
		{"01", false},
		{"Default string 2", false},
		{"OEM-1234", false},
	} {
		if got := IsPlaceholder(tc.in); got != tc.want {
			t.Errorf("R6.1 IsPlaceholder(%q) = %v, want %v", tc.in, got, tc.want)
		}
	}
}

// R5.2, R6.1: placeholder UUIDs.
func TestIsPlaceholderUUID(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want bool
	}{
		{"00000000-0000-0000-0000-000000000000", true},
		{"{00000000-0000-0000-0000-000000000000}", true},
		{"FFFFFFFF-FFFF-FFFF-FFFF-FFFFFFFFFFFF", true},
		{"03000200-0400-0500-0006-000700080009", true},
		{"03000200040005000006000700080009", true},
		{"Not Settable", true},
		{"4C4C4544-0042-3510-8052-B4C04F4E3732", false},
		{"not a uuid", false},
	} {
		if got := IsPlaceholderUUID(tc.in); got != tc.want {
			t.Errorf("R5.2 IsPlaceholderUUID(%q) = %v, want %v", tc.in, got, tc.want)
		}
	}
}

const (
	uuidA   = "4c4c4544-0042-3510-8052-b4c04f4e3732"
	uuidB   = "4c4c4544-0042-3510-8052-b4c04f4e3733"
	macA    = "3c:ec:ef:01:02:03"
	macB    = "3c:ec:ef:01:02:04"
	gpuA    = "GPU-8f0c1d2e-aaaa-bbbb-cccc-ddddeeeeffff"
	serialA = "CZ2345ABCD"
)

func key(t *testing.T, c Claims) HardwareKey {
	t.Helper()
	k, err := KeyOf(c)
	if err != nil {
		t.Fatalf("KeyOf(%+v): %v", c, err)
	}
	return k
}

// R6.1, R6.2: which keys are present and trusted.
func TestKeyTrust(t *testing.T) {
	for _, tc := range []struct {
		name                    string
		in                      Claims
		present, trusted        bool
		stable                  bool
		identifiers, kinds      int
		hasUUIDOrSerial         bool
		placeholderHardwareR6_2 bool
	}{
		{"R6.1 uuid and serial: trusted, stable", Claims{ProductUUID: uuidA, ProductSerial: serialA},
			true, true, true, 2, 2, true, false},
		{"R6.1 uuid and mac: trusted, not stable", Claims{ProductUUID: uuidA, MACs: []string{macA}},
			true, true, false, 2, 2, true, false},
		{"R6.1 serial and gpu: trusted, not stable", Claims{BoardSerial: serialA, GPUUUIDs: []string{gpuA}},
			true, true, false, 2, 2, true, false},
		{"R6.1 mac and gpu: trusted but no uuid or serial (R6.2)", Claims{MACs: []string{macA}, GPUUUIDs: []string{gpuA}},
			true, true, false, 2, 2, false, true},
		{"R6.1 all four kinds: stable", Claims{ProductUUID: uuidA, ChassisSerial: serialA, MACs: []string{macA, macB}, GPUUUIDs: []string{gpuA}},
			true, true, true, 5, 4, true, false},
		{"R6.1 uuid alone: untrusted", Claims{ProductUUID: uuidA},
			true, false, false, 1, 1, true, true},
		{"R6.1 two macs are one kind: untrusted", Claims{MACs: []string{macA, macB}},
			true, false, false, 2, 1, false, true},
		{"R6.1 three different serials are one kind: untrusted", Claims{ProductSerial: "S1X", BoardSerial: "S2Y", ChassisSerial: "S3Z"},
			true, false, false, 3, 1, true, true},
		{"R6.1 the same serial in every slot counts once", Claims{ProductSerial: serialA, BoardSerial: " cz2345abcd ", ChassisSerial: serialA},
			true, false, false, 1, 1, true, true},
		{"R6.1 placeholders dropped: uuid and serial placeholders leave one mac", Claims{
			ProductUUID: "03000200-0400-0500-0006-000700080009", ProductSerial: "To Be Filled By O.E.M.",
			BoardSerial: "Default string", ChassisSerial: "Chassis Serial Number", MACs: []string{macA}},
			true, false, false, 1, 1, false, true},
		{"R6.1 locally administered macs ignored", Claims{ProductUUID: uuidA, MACs: []string{"02:42:ac:11:00:02"}},
			true, false, false, 1, 1, true, true},
		{"R6.1 placeholder gpu dropped", Claims{ProductUUID: uuidA, GPUUUIDs: []string{"GPU-00000000-0000-0000-0000-000000000000"}},
			true, false, false, 1, 1, true, true},
		{"R6.1 a placeholder uuid is no stable identifier: serial and mac, trusted, not stable", Claims{
			ProductUUID: "00000000-0000-0000-0000-000000000000", ProductSerial: serialA, MACs: []string{macA}},
			true, true, false, 2, 2, true, false},
		{"R6.1 a placeholder serial is no stable identifier: uuid and gpu, trusted, not stable", Claims{
			ProductUUID: uuidA, ProductSerial: "System Serial Number", GPUUUIDs: []string{gpuA}},
			true, true, false, 2, 2, true, false},
		{"R6.1 nothing left: missing", Claims{ProductUUID: "00000000-0000-0000-0000-000000000000", ProductSerial: "0", Hostname: "h"},
			false, false, false, 0, 0, false, true},
		{"R6.1 empty claims: missing", Claims{},
			false, false, false, 0, 0, false, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			k := key(t, tc.in)
			if k.Present != tc.present || k.Trusted != tc.trusted || k.Stable != tc.stable || k.Identifiers != tc.identifiers ||
				k.Kinds != tc.kinds || k.HasUUIDOrSerial != tc.hasUUIDOrSerial {
				t.Errorf("got %+v, want present=%v trusted=%v stable=%v identifiers=%d kinds=%d hasUUIDOrSerial=%v",
					k, tc.present, tc.trusted, tc.stable, tc.identifiers, tc.kinds, tc.hasUUIDOrSerial)
			}
			if got := k.PlaceholderHardware(); got != tc.placeholderHardwareR6_2 {
				t.Errorf("R6.2 PlaceholderHardware = %v, want %v", got, tc.placeholderHardwareR6_2)
			}
			if !k.Present {
				if k.Hash != [32]byte{} || k.Hex() != "" || k.String() != "none" {
					t.Errorf("missing key has hash %x hex %q string %q", k.Hash, k.Hex(), k.String())
				}
			} else if len(k.Hex()) != 64 || k.String() != k.Hex() {
				t.Errorf("Hex %q String %q", k.Hex(), k.String())
			}
		})
	}
}

// R6.1: the key does not depend on order, case, separators, white space,
// serial slot, hostname or ignored MACs.
func TestKeyStable(t *testing.T) {
	base := Claims{ProductUUID: uuidA, ProductSerial: serialA, MACs: []string{macA, macB}, GPUUUIDs: []string{gpuA}, Hostname: "a"}
	want := key(t, base)
	for _, tc := range []struct {
		name string
		in   Claims
	}{
		{"R6.1 uuid upper case undashed", Claims{ProductUUID: "4C4C454400423510" + "8052B4C04F4E3732", ProductSerial: serialA, MACs: []string{macA, macB}, GPUUUIDs: []string{gpuA}}},
		{"R6.1 macs reordered, other separators, upper case", Claims{ProductUUID: uuidA, ProductSerial: serialA, MACs: []string{"3C-EC-EF-01-02-04", "3CEC.EF01.0203"}, GPUUUIDs: []string{gpuA}}},
		{"R6.1 serial in another slot, other case", Claims{ProductUUID: uuidA, BoardSerial: " cz2345abcd", MACs: []string{macA, macB}, GPUUUIDs: []string{gpuA}}},
		{"R6.1 serial repeated, placeholders elsewhere", Claims{ProductUUID: uuidA, ProductSerial: serialA, BoardSerial: "CZ2345ABCD", ChassisSerial: "Default string", MACs: []string{macA, macB}, GPUUUIDs: []string{gpuA}}},
		{"R6.1 gpu case", Claims{ProductUUID: uuidA, ProductSerial: serialA, MACs: []string{macA, macB}, GPUUUIDs: []string{"gpu-8F0C1D2E-AAAA-BBBB-CCCC-DDDDEEEEFFFF"}}},
		{"R6.1 hostname and ignored macs", Claims{ProductUUID: uuidA, ProductSerial: serialA, MACs: []string{"02:00:00:00:00:01", macB, macA}, GPUUUIDs: []string{gpuA}, Hostname: "other"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := key(t, tc.in); got != want {
				t.Errorf("key %s, want %s", got, want)
			}
		})
	}
}

// R6.1: any identifier the key is derived from changes it when it differs.
// A stable key is derived from the product UUID and the serials; a full key
// from every identifier.
func TestKeyDiffers(t *testing.T) {
	stable := Claims{ProductUUID: uuidA, ProductSerial: serialA, MACs: []string{macA}, GPUUUIDs: []string{gpuA}}
	full := Claims{ProductSerial: serialA, MACs: []string{macA}, GPUUUIDs: []string{gpuA}}
	for _, tc := range []struct {
		name     string
		base, in Claims
	}{
		{"R6.1 stable: other uuid", stable, Claims{ProductUUID: uuidB, ProductSerial: serialA, MACs: []string{macA}, GPUUUIDs: []string{gpuA}}},
		{"R6.1 stable: other serial", stable, Claims{ProductUUID: uuidA, ProductSerial: serialA + "1", MACs: []string{macA}, GPUUUIDs: []string{gpuA}}},
		{"R6.1 stable: extra serial", stable, Claims{ProductUUID: uuidA, ProductSerial: serialA, BoardSerial: "B1", MACs: []string{macA}, GPUUUIDs: []string{gpuA}}},
		{"R6.1 stable: the uuid gone", stable, Claims{ProductSerial: serialA, MACs: []string{macA}, GPUUUIDs: []string{gpuA}}},
		{"R6.1 full: other serial", full, Claims{ProductSerial: serialA + "1", MACs: []string{macA}, GPUUUIDs: []string{gpuA}}},
		{"R6.1 full: other mac", full, Claims{ProductSerial: serialA, MACs: []string{macB}, GPUUUIDs: []string{gpuA}}},
		{"R6.1 full: extra mac", full, Claims{ProductSerial: serialA, MACs: []string{macA, macB}, GPUUUIDs: []string{gpuA}}},
		{"R6.1 full: no gpu", full, Claims{ProductSerial: serialA, MACs: []string{macA}}},
		{"R6.1 full: other gpu", full, Claims{ProductSerial: serialA, MACs: []string{macA}, GPUUUIDs: []string{gpuA + "0"}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got, want := key(t, tc.in), key(t, tc.base); got.Hash == want.Hash {
				t.Errorf("same key %s", got)
			}
		})
	}
	// The kind is part of the encoding: the same value as a serial and as a
	// GPU UUID gives different keys.
	a := key(t, Claims{ProductUUID: uuidA, ProductSerial: "gpu-x"})
	b := key(t, Claims{ProductUUID: uuidA, GPUUUIDs: []string{"gpu-x"}})
	if a == b {
		t.Errorf("R6.1 serial and gpu with the same value give the same key")
	}
	// The domain is part of the encoding: a stable key never equals the
	// full key of the same identifiers.
	if s, f := key(t, Claims{ProductUUID: uuidA, ProductSerial: serialA}), hashIdentifiers(keyDomain, []ident{{kindSerial, "cz2345abcd"}, {kindUUID, uuidA}}); s.Hash == f {
		t.Errorf("R6.1 the stable key equals the full key of its identifiers")
	}
}

// R6.3: a replaced, added or removed NIC or GPU keeps a stable key, so the
// machine stays its node; a machine without a stable key is named by its
// parts too.
func TestKeyPartSwap(t *testing.T) {
	for _, tc := range []struct {
		name       string
		before     Claims
		after      Claims
		sameKey    bool
		trustAfter bool
	}{
		{"R6.3 NIC replaced", Claims{ProductUUID: uuidA, ProductSerial: serialA, MACs: []string{macA}},
			Claims{ProductUUID: uuidA, ProductSerial: serialA, MACs: []string{macB}}, true, true},
		{"R6.3 NIC added", Claims{ProductUUID: uuidA, ProductSerial: serialA, MACs: []string{macA}},
			Claims{ProductUUID: uuidA, ProductSerial: serialA, MACs: []string{macA, macB}}, true, true},
		{"R6.3 every NIC removed", Claims{ProductUUID: uuidA, ProductSerial: serialA, MACs: []string{macA, macB}},
			Claims{ProductUUID: uuidA, ProductSerial: serialA}, true, true},
		{"R6.3 GPU replaced", Claims{ProductUUID: uuidA, BoardSerial: serialA, GPUUUIDs: []string{gpuA}},
			Claims{ProductUUID: uuidA, BoardSerial: serialA, GPUUUIDs: []string{"GPU-1111"}}, true, true},
		{"R6.3 NIC and GPU replaced together", Claims{ProductUUID: uuidA, ChassisSerial: serialA, MACs: []string{macA}, GPUUUIDs: []string{gpuA}},
			Claims{ProductUUID: uuidA, ChassisSerial: serialA, MACs: []string{macB}, GPUUUIDs: []string{"GPU-2222"}}, true, true},
		{"R6.3 NIC replaced on a machine with a serial only: a new machine", Claims{ProductSerial: serialA, MACs: []string{macA}},
			Claims{ProductSerial: serialA, MACs: []string{macB}}, false, true},
		{"R6.3 NIC replaced on a machine with a placeholder uuid: a new machine", Claims{ProductUUID: "03000200-0400-0500-0006-000700080009", ProductSerial: serialA, MACs: []string{macA}},
			Claims{ProductUUID: "03000200-0400-0500-0006-000700080009", ProductSerial: serialA, MACs: []string{macB}}, false, true},
		{"R6.3 the board replaced (uuid and serial): a new machine", Claims{ProductUUID: uuidA, ProductSerial: serialA, MACs: []string{macA}},
			Claims{ProductUUID: uuidB, ProductSerial: "CZ9999ZZZZ", MACs: []string{macA}}, false, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a, b := key(t, tc.before), key(t, tc.after)
			if (a.Hash == b.Hash) != tc.sameKey {
				t.Errorf("same key = %v, want %v (%+v, %+v)", a.Hash == b.Hash, tc.sameKey, a, b)
			}
			if b.Trusted != tc.trustAfter {
				t.Errorf("trusted after = %v, want %v", b.Trusted, tc.trustAfter)
			}
		})
	}
}

// encode is the canonical encoding of Key, written out again.
func encode(domain string, kv [][2]string) string {
	h := sha256.New()
	put := func(s string) {
		h.Write(binary.BigEndian.AppendUint32(nil, uint32(len(s))))
		h.Write([]byte(s))
	}
	put(domain)
	h.Write(binary.BigEndian.AppendUint32(nil, uint32(len(kv))))
	for _, x := range kv {
		put(x[0])
		put(x[1])
	}
	return hex.EncodeToString(h.Sum(nil))
}

// R6.1: the encodings are pinned: keys are stored, and the Inventory
// controller and JoinService must derive the same one.
func TestKeyEncoding(t *testing.T) {
	for _, tc := range []struct {
		name   string
		in     Claims
		domain string
		kv     [][2]string
		golden string
	}{
		{
			// A full key: no product UUID, so every identifier is hashed.
			name: "full",
			in: Claims{ProductUUID: "00000000-0000-0000-0000-000000000000", ProductSerial: "CZ2345ABCD", BoardSerial: "Default string",
				MACs: []string{"3C:EC:EF:01:02:04", "3cecef010203"}, GPUUUIDs: []string{"GPU-ABC"}},
			domain: "better-compute hwkey v1",
			kv: [][2]string{
				{"gpu", "gpu-abc"},
				{"mac", "3c:ec:ef:01:02:03"},
				{"mac", "3c:ec:ef:01:02:04"},
				{"serial", "cz2345abcd"},
			},
			golden: "b11ba51e429ff912228d861f962e099034986641af8afd91aa0d8cb43bea3d2d",
		},
		{
			// A stable key: the product UUID and the serials only.
			name: "stable",
			in: Claims{ProductUUID: "4C4C4544-0042-3510-8052-B4C04F4E3732", ProductSerial: "CZ2345ABCD", BoardSerial: "Default string",
				ChassisSerial: "CH-1", MACs: []string{"3C:EC:EF:01:02:04", "3cecef010203"}, GPUUUIDs: []string{"GPU-ABC"}},
			domain: "better-compute hwkey stable v1",
			kv: [][2]string{
				{"serial", "ch-1"},
				{"serial", "cz2345abcd"},
				{"uuid", "4c4c4544-0042-3510-8052-b4c04f4e3732"},
			},
			golden: "0527863cce3624a375be541b39132b4760751f9c33995fa53f8e80b36144f315",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			want := encode(tc.domain, tc.kv)
			if tc.name == "full" {
				// The full encoding is the one keys had before stable keys
				// existed: this is that golden, unchanged.
				if old := encode("better-compute hwkey v1", [][2]string{{"gpu", "gpu-abc"}, {"mac", "3c:ec:ef:01:02:03"}, {"mac", "3c:ec:ef:01:02:04"},
					{"serial", "cz2345abcd"}, {"uuid", "4c4c4544-0042-3510-8052-b4c04f4e3732"}}); old != "8e81dbb80e62edfda769634645865ed9dc3a2f183966f797dafd675d3a739685" {
					t.Errorf("R6.1 the full encoding changed: %s", old)
				}
			}
			if got := key(t, tc.in).Hex(); got != want {
				t.Errorf("R6.1 key %s, want %s", got, want)
			}
			// A stored key must never change: a new encoding needs a new
			// domain.
			if want != tc.golden {
				t.Errorf("R6.1 key %s, want golden %s", want, tc.golden)
			}
		})
	}
}
