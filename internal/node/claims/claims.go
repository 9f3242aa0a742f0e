// Package claims collects the hardware claims bcd sends with Join (R4.3):
// the DMI product UUID and serials, the permanent MACs of physical NICs, the
// NVIDIA GPU UUIDs and the hostname, read from sysfs and procfs.
//
// It reports what the machine says and decides nothing: placeholder values
// (To Be Filled By O.E.M., all-zero UUIDs) are passed on as they are, because
// internal/shared/hwid is the one place that recognizes them. It does drop MACs that
// cannot be permanent NIC addresses (virtual interfaces, random or set
// addresses, locally administered, multicast, zero), since sending them would
// only make the claims look like another machine's.
//
// What cannot be read (a DMI file only root may read, a machine without DMI)
// is left empty with a warning, never a failure: the join decides whether
// enough identifiers remain.
package claims

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/fsutil"
	"github.com/better-compute/better-compute/internal/shared/hwid"
)

// maxFileSize bounds every sysfs or procfs file read here.
const maxFileSize = 4 << 10

// Config says where to read. Empty roots mean /sys and /proc.
type Config struct {
	SysfsRoot  string
	ProcfsRoot string
	// Hostname returns the host name; nil means os.Hostname. Tests set it.
	Hostname func() (string, error)
}

// Collector reads claims; build it with New.
type Collector struct {
	sysfs, procfs string
	hostname      func() (string, error)
}

// New returns a Collector for cfg.
func New(cfg Config) *Collector {
	c := &Collector{sysfs: cfg.SysfsRoot, procfs: cfg.ProcfsRoot, hostname: cfg.Hostname}
	if c.sysfs == "" {
		c.sysfs = "/sys"
	}
	if c.procfs == "" {
		c.procfs = "/proc"
	}
	if c.hostname == nil {
		c.hostname = os.Hostname
	}
	return c
}

// Collect reads the claims under sysfsRoot and procfsRoot with the real
// hostname. See Collector.Collect.
func Collect(sysfsRoot, procfsRoot string) (hwid.Claims, []string, error) {
	return New(Config{SysfsRoot: sysfsRoot, ProcfsRoot: procfsRoot}).Collect()
}

// DMI files read for the product UUID and serials, under
// <sysfs>/class/dmi/id.
const (
	dmiDir           = "class/dmi/id"
	dmiProductUUID   = "product_uuid"
	dmiProductSerial = "product_serial"
	dmiBoardSerial   = "board_serial"
	dmiChassisSerial = "chassis_serial"
)

// Collect reads the claims. Warnings say, in a line each, what could not
// be read and was left out; bcd logs them. The error is errs.InvalidConfig
// when the sysfs root does not exist (a wrong sysfs_root), or
// errs.InvalidState when the claims would be refused by hwid as they are
// (e.g. more NICs than hwid.MaxMACs, a control character in a serial), so
// the operator learns it before spending a join.
func (c *Collector) Collect() (hwid.Claims, []string, error) {
	var cl hwid.Claims
	var warnings []string
	warn := func(format string, args ...any) { warnings = append(warnings, fmt.Sprintf(format, args...)) }

	if st, err := os.Stat(c.sysfs); err != nil || !st.IsDir() {
		return hwid.Claims{}, nil, errs.New(errs.InvalidConfig, "sysfs_root %s is not a directory", c.sysfs)
	}

	// DMI. product_uuid is commonly readable by root only.
	dmi := filepath.Join(c.sysfs, dmiDir)
	if _, err := os.Stat(dmi); err != nil {
		warn("no DMI information (%s): the product UUID and serials are not claimed", dmi)
	} else {
		for _, f := range []struct {
			name string
			dst  *string
		}{
			{dmiProductUUID, &cl.ProductUUID},
			{dmiProductSerial, &cl.ProductSerial},
			{dmiBoardSerial, &cl.BoardSerial},
			{dmiChassisSerial, &cl.ChassisSerial},
		} {
			v, err := readTrimmed(filepath.Join(dmi, f.name))
			if err != nil {
				warn("%s not claimed: %v", f.name, err)
				continue
			}
			*f.dst = v
		}
	}

	if h, err := c.hostname(); err != nil {
		warn("hostname not claimed: %v", err)
	} else {
		cl.Hostname = strings.TrimSpace(h)
	}

	macs, w := c.macs()
	warnings = append(warnings, w...)
	cl.MACs = macs

	gpus, w := c.gpus()
	warnings = append(warnings, w...)
	cl.GPUUUIDs = gpus

	if err := hwid.Validate(cl); err != nil {
		var ce *hwid.ClaimError
		if errors.As(err, &ce) {
			return hwid.Claims{}, warnings, errs.New(errs.InvalidState,
				"this machine's hardware claims would be refused (%s in %s); check what %s reports", ce.Reason, ce.Field, c.sysfs)
		}
		return hwid.Claims{}, warnings, fmt.Errorf("validate claims: %w", err)
	}
	return cl, warnings, nil
}

// macs returns the permanent, globally administered unicast MACs of
// physical NICs, lower case and colon separated, sorted and unique.
//
// A NIC is physical when its sysfs directory has a device entry (bridges,
// bonds, veths, tunnels and VLANs have none). Its permanent address is
// bonding_slave/perm_hwaddr when the NIC is enslaved to a bond (the bond
// rewrites address), else address when addr_assign_type is 0 (NET_ADDR_PERM)
// or absent. A random (1), stolen (2) or set (3) address is not permanent.
func (c *Collector) macs() ([]string, []string) {
	netDir := filepath.Join(c.sysfs, "class", "net")
	entries, err := os.ReadDir(netDir)
	if err != nil {
		return nil, []string{fmt.Sprintf("no MACs claimed: cannot list %s: %v", netDir, errText(err))}
	}
	var macs, warnings []string
	for _, e := range entries {
		iface := filepath.Join(netDir, e.Name())
		// Lstat: the device entry is a symlink into /sys/devices and
		// need not resolve for the NIC to be physical.
		if _, err := os.Lstat(filepath.Join(iface, "device")); err != nil {
			continue
		}
		addrFile := filepath.Join(iface, "bonding_slave", "perm_hwaddr")
		if _, err := os.Lstat(addrFile); err != nil {
			addrFile = filepath.Join(iface, "address")
			assign, err := readTrimmed(filepath.Join(iface, "addr_assign_type"))
			switch {
			case err == nil && assign != "0":
				continue
			case err != nil && !errors.Is(err, fs.ErrNotExist):
				warnings = append(warnings, fmt.Sprintf("MAC of %s not claimed: %v", e.Name(), err))
				continue
			}
		}
		raw, err := readTrimmed(addrFile)
		if err != nil {
			warnings = append(warnings, fmt.Sprintf("MAC of %s not claimed: %v", e.Name(), err))
			continue
		}
		if mac, ok := permanentMAC(raw); ok && !slices.Contains(macs, mac) {
			macs = append(macs, mac)
		}
	}
	slices.Sort(macs)
	return macs, warnings
}

// permanentMAC parses a 6-octet MAC and keeps it only when it can be a
// burnt-in NIC address: unicast, globally administered, not zero.
func permanentMAC(s string) (string, bool) {
	hw, err := net.ParseMAC(s)
	if err != nil || len(hw) != 6 {
		return "", false // InfiniBand and other non-Ethernet layouts
	}
	if hw[0]&0x01 != 0 || hw[0]&0x02 != 0 || bytes.Equal(hw, make(net.HardwareAddr, 6)) {
		return "", false
	}
	return hw.String(), true
}

// gpus returns the NVIDIA GPU UUIDs from
// <procfs>/driver/nvidia/gpus/*/information ("GPU UUID:  GPU-…"), sorted
// and unique. A machine without the NVIDIA driver has none, silently.
func (c *Collector) gpus() ([]string, []string) {
	dir := filepath.Join(c.procfs, "driver", "nvidia", "gpus")
	entries, err := os.ReadDir(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, []string{fmt.Sprintf("no GPU UUIDs claimed: cannot list %s: %v", dir, errText(err))}
	}
	var uuids, warnings []string
	for _, e := range entries {
		path := filepath.Join(dir, e.Name(), "information")
		data, err := readBounded(path)
		if err != nil {
			warnings = append(warnings, fmt.Sprintf("GPU %s not claimed: %v", e.Name(), err))
			continue
		}
		found := false
		sc := bufio.NewScanner(bytes.NewReader(data))
		for sc.Scan() {
			key, val, ok := strings.Cut(sc.Text(), ":")
			if !ok || strings.TrimSpace(key) != "GPU UUID" {
				continue
			}
			if v := strings.TrimSpace(val); v != "" {
				found = true
				if !slices.Contains(uuids, v) {
					uuids = append(uuids, v)
				}
			}
			break
		}
		if !found {
			warnings = append(warnings, fmt.Sprintf("GPU %s not claimed: no GPU UUID line in %s", e.Name(), path))
		}
	}
	slices.Sort(uuids)
	return uuids, warnings
}

// readTrimmed reads a small file and trims surrounding white space.
func readTrimmed(path string) (string, error) {
	data, err := readBounded(path)
	if err != nil {
		return "", err
	}
	return strings.TrimSpace(string(data)), nil
}

func readBounded(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, fsutil.WithoutPath(err))
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, maxFileSize+1))
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, fsutil.WithoutPath(err))
	}
	if len(data) > maxFileSize {
		return nil, fmt.Errorf("%s: larger than %d bytes", path, maxFileSize)
	}
	return data, nil
}

func errText(err error) string { return fsutil.WithoutPath(err).Error() }
